"""Streams (torch's or Hugging Face's `IterableDataset`) split across ranks and loader workers.

Item j of an epoch's stream goes to rank j mod world_size, so the first P items are consumed exactly when every
rank has taken P / world_size: a run resumed at P, on any number of ranks, goes on with item P. Within a rank,
batch b goes to loader worker b mod workers, so a DataLoader (one batch from each worker in turn) yields the
rank's batches in stream order whatever its worker count.

A dataset whose `shards_itself` is true yields only its own process's and worker's share and is read as it is
(engine/loop/setup.py finds it out where the user does not say). One with a `share(...)` method (ddplab.Shards)
seeks itself to exactly what `owns` gives a rank's worker, so it resumes with nothing read twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any, NamedTuple

from torch.utils.data import IterableDataset, get_worker_info


def is_stream(dataset) -> bool:
    return isinstance(dataset, IterableDataset)


def size(dataset) -> int | None:
    """len(dataset), or None for a stream that does not know its length."""
    try:
        return len(dataset)
    except TypeError:
        return None


def declared(dataset, limit: int | None = None) -> int | None:
    """len(dataset), at most data.limit (None: unknown)."""
    n = size(dataset)
    return n if n is None or limit is None else min(n, limit)


def is_stateful(dataset) -> bool:
    """A stream that saves and restores its own position (Hugging Face's, torchdata's)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def shards_itself(dataset) -> bool:
    return bool(getattr(dataset, "shards_itself", False))


def said_how(dataset) -> bool:
    """Whether the dataset says how it is sharded: `shards_itself` (True or False) or `share` (ddplab.Shards)."""
    return hasattr(dataset, "shards_itself") or callable(getattr(dataset, "share", None))


def owns(j, rank: int, world_size: int, batch_size: int, worker: int, workers: int):
    """Whether item j (an int or an array of them) of the global stream is this rank's and loader worker's."""
    return (j % world_size == rank) & ((j // world_size // batch_size) % workers == worker)


class Stream(IterableDataset):
    """This rank's share of `dataset`, from item `start` of epoch `epoch` on (set_epoch), at most
    `limit` items of the whole stream (data.limit). `marked`: each loader worker's last item comes as Last (for
    Tagged: training's loader)."""

    def __init__(
        self, dataset, rank: int, world_size: int, batch_size: int, limit: int | None = None, marked: bool = False
    ) -> None:
        self.dataset, self.batch_size, self.limit, self.marked = dataset, batch_size, limit, marked
        self.own, self.seeks = shards_itself(dataset), callable(getattr(dataset, "share", None))
        self.rank, self.world_size = (0, 1) if self.own else (rank, world_size)
        self.set_epoch(0)

    def set_epoch(self, epoch: int, start: int = 0, skip: bool = True, per_worker: list[int] | None = None) -> None:
        """Begin `epoch` after its first `start` items (of the global stream; of this rank's, when it shards
        itself): read past them (`skip`), or not, where the dataset's own restored state already is there.
        `per_worker`: a stream that shards itself, read by loader workers: each worker's own count to read past."""
        self.epoch, self.start, self.skip, self.per_worker = epoch, start, skip, per_worker

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
        start = self.start if self.per_worker is None else self.per_worker[0 if info is None else info.id]
        end = self.limit if self.limit is None or self.skip else max(self.limit - start, 0)
        items = islice(self.dataset, start if self.skip else 0, end)
        if self.own and self.marked and info is not None:  # each worker's share ends on its own: its last item says so
            held = next(items, Last)
            for item in items:
                yield held
                held = item
            if held is not Last:
                yield Last(held)
            return
        for j, item in enumerate(items):
            if owns(j, self.rank, self.world_size, self.batch_size, worker, workers):
                yield item


class Last(NamedTuple):
    """The last item of a loader worker's share (Stream marks it, Tagged takes the mark off)."""

    item: Any


class Batch(NamedTuple):
    worker: int  # the loader worker that made it (0 without workers)
    items: int
    batch: Any  # what collate_fn made
    last: bool  # the last of its worker's share (a stream that shards itself)


class Tagged:
    """A loader's collate_fn around `collate`: each batch as a Batch, so that the training process knows how
    far each worker's share has been trained, and when it ended."""

    def __init__(self, collate: Callable) -> None:
        self.collate = collate

    def __call__(self, items: list) -> Batch:
        info = get_worker_info()
        last = bool(items) and isinstance(items[-1], Last)
        if last:
            items = [*items[:-1], items[-1].item]
        return Batch(0 if info is None else info.id, len(items), self.collate(items), last)


class FirstItems(IterableDataset):
    """`fingerprint(dataset)` as each loader worker reads it: one item per worker."""

    def __init__(self, dataset, fingerprint: Callable) -> None:
        self.dataset, self.fingerprint = dataset, fingerprint

    def __iter__(self) -> Iterator:
        yield self.fingerprint(self.dataset)
