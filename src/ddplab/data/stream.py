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

A dataset with a `share(epoch, start, end, rank, world_size, batch_size, worker, workers)` method
(ddplab.Shards) seeks itself: it yields exactly the items `owns` gives a rank's loader worker, from
any position of its global order without reading what comes before, so a run resumes at any world
size or worker count with nothing read twice.
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


def owns(j, rank: int, world_size: int, batch_size: int, worker: int, workers: int):
    """Whether item j of the global stream (an int or an array of them) is the given rank's and loader
    worker's: rank j mod world_size, and within it whole batches to the workers in turn."""
    return (j % world_size == rank) & ((j // world_size // batch_size) % workers == worker)


class Stream(IterableDataset):
    """This rank's share of `dataset`, from item `start` of epoch `epoch` on (set_epoch), at most
    `limit` items of the whole stream (data.limit)."""

    def __init__(self, dataset, rank: int, world_size: int, batch_size: int, limit: int | None = None) -> None:
        self.dataset, self.batch_size, self.limit = dataset, batch_size, limit
        self.own, self.seeks = shards_itself(dataset), callable(getattr(dataset, "share", None))
        self.rank, self.world_size = (0, 1) if self.own else (rank, world_size)
        self.set_epoch(0)

    def set_epoch(self, epoch: int, start: int = 0, skip: bool = True) -> None:
        """Begin `epoch` after its first `start` items (of the global stream; of this rank's, when it shards
        itself): read past them (`skip`), or not, where the dataset's own restored state already is there."""
        self.epoch, self.start, self.skip = epoch, start, skip

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        workers, worker = (1, 0) if info is None or self.own else (info.num_workers, info.id)
        if self.seeks:
            yield from self.dataset.share(
                self.epoch, self.start, self.limit, self.rank, self.world_size, self.batch_size, worker, workers
            )
            return
        if callable(getattr(self.dataset, "set_epoch", None)):  # a shuffling stream reshuffles per epoch
            self.dataset.set_epoch(self.epoch)
        end = self.limit if self.limit is None or self.skip else max(self.limit - self.start, 0)
        items = islice(self.dataset, self.start if self.skip else 0, end)
        for j, item in enumerate(items):
            if owns(j, self.rank, self.world_size, self.batch_size, worker, workers):
                yield item
