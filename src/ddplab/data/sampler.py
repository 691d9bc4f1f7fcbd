"""`ResumableDistributedSampler`: torch's `DistributedSampler` (same permutation, padding and rank-strided split)
that starts part-way through an epoch in O(1): what an epoch consumed is a prefix of its permutation, so resuming
is slicing, and the rest is re-divided among however many ranks there are now.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import cast

import torch
from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    start = 0  # samples of the epoch's global order already consumed
    keyed = False  # yield (epoch, index) for a dataset that seeds each sample (data.sample_seed.PerSampleSeed)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Begin `epoch`, skipping the first `start` samples of its global order."""
        super().set_epoch(epoch)
        self.start = start

    @property
    def _dataset_len(self) -> int:
        # torch types the dataset as a Dataset, which declares no __len__; a sampler's dataset has one.
        return len(cast(Sized, self.dataset))

    def __iter__(self) -> Iterator:
        if self.shuffle:  # the epoch's order of the whole dataset, identical on every rank
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self._dataset_len, generator=g).tolist()
        else:
            order = list(range(self._dataset_len))
        # Pad (or cut) what is left, not the whole epoch, so that a world size that changed
        # on resume still gets equal shares. Padding repeats the epoch's first samples, as
        # DistributedSampler does, so an unchanged world size sees exactly its order.
        rest = order[self.start :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.num_replicas]
        else:
            pad = -len(rest) % self.num_replicas
            rest += (order * math.ceil(pad / max(len(order), 1)))[:pad]
        mine = rest[self.rank :: self.num_replicas]
        return iter([(self.epoch, i) for i in mine] if self.keyed else mine)

    def __len__(self) -> int:
        rest = max(self._dataset_len - self.start, 0)
        return rest // self.num_replicas if self.drop_last else math.ceil(rest / self.num_replicas)
