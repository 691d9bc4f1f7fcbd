"""Streams (iterable datasets: torch's `IterableDataset`, Hugging Face's streaming `IterableDataset`)
split across ranks and loader workers.

Item j of an epoch's stream goes to rank j mod world_size, so the first P items of the global
stream are consumed exactly when every rank has taken P / world_size: a run resumed at P, on any
number of ranks, goes on with item P. Within a rank, whole batches go to loader workers in turn
(batch b to worker b mod workers), so a DataLoader, which takes one batch from each worker in
turn, yields the rank's batches in stream order whatever its worker count.

A dataset whose attribute `shards_itself` is true yields only its own process's (and loader
worker's) share, as one built with `datasets.distributed.split_dataset_by_node` does; it is read
as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

from torch.utils.data import IterableDataset, get_worker_info


def is_stream(dataset) -> bool:
    return isinstance(dataset, IterableDataset)


def size(dataset) -> int | None:
    """len(dataset), or None for a stream that does not know its length."""
    try:
        return len(dataset)
    except TypeError:
        return None


def is_stateful(dataset) -> bool:
    """A stream that saves and restores its own position (Hugging Face's, torchdata's)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def shards_itself(dataset) -> bool:
    return bool(getattr(dataset, "shards_itself", False))


class Stream(IterableDataset):
    """This rank's share of `dataset`, from item `start` of epoch `epoch` on (set_epoch), at most
    `limit` items of the whole stream (data.limit)."""

    def __init__(self, dataset, rank: int, world_size: int, batch_size: int, limit: int | None = None) -> None:
        self.dataset, self.batch_size, self.limit = dataset, batch_size, limit
        self.own = shards_itself(dataset)
        self.rank, self.world_size = (0, 1) if self.own else (rank, world_size)
        self.epoch = self.start = 0
        self.skip = True

    def set_epoch(self, epoch: int, start: int = 0, skip: bool = True) -> None:
        """Begin `epoch` after its first `start` items (of the global stream; of this rank's, when it shards
        itself): read past them (`skip`), or not, where the dataset's own restored state already is there."""
        self.epoch, self.start, self.skip = epoch, start, skip

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        workers, worker = (1, 0) if info is None or self.own else (info.num_workers, info.id)
        if callable(getattr(self.dataset, "set_epoch", None)):  # a shuffling stream reshuffles per epoch
            self.dataset.set_epoch(self.epoch)
        end = self.limit if self.limit is None or self.skip else max(self.limit - self.start, 0)
        items = islice(self.dataset, self.start if self.skip else 0, end)
        for j, item in enumerate(items):
            if j % self.world_size == self.rank and (j // self.world_size // self.batch_size) % workers == worker:
                yield item
