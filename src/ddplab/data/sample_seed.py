"""Random augmentation drawn from a per-sample seed, so that a sample is augmented the same whatever the
world size, the worker count or the point a run resumed from.

`PerSampleSeed` wraps a map-style training set. The training sampler hands it `(epoch, index)` keys
(`ResumableDistributedSampler.keyed`); each item is read with torch's CPU generator seeded from
(experiment.seed, epoch, index), and with Python's `random` and numpy's global generator seeded the same
way where reading draws from them. The callers' generators are put back after each batch, so training's
own draws (dropout) are untouched.

torchvision's transforms draw from torch's generator, which costs about a microsecond to seed. Seeding
Python's and numpy's generators, and keeping the caller's, costs several times more, so they are seeded
only where reading was seen to draw from them: a few samples spread over the dataset are read once, when
it is wrapped, and the generators whose state moved are seeded from then on. Every process reads the same
samples under the same seeds there, so every world size decides alike. A transform that draws from one
of them only now and then, and in none of those samples, keeps each process's own draws of it.

Streams (IterableDataset) are not wrapped: a stream has no index to seed from, and keeps each rank's own
draws.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

MASK = (1 << 64) - 1
PROBES = 16  # samples read when a dataset is wrapped, to see which generators reading draws from


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A seed for one sample of one epoch: splitmix64's finaliser over the three, so neighbouring samples'
    streams are unrelated (a tenth of hashlib's time)."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


@contextmanager
def kept(get, put):
    """A generator's state as it was before, whatever was drawn or seeded inside."""
    state = get()
    try:
        yield
    finally:
        put(state)


def _seed_torch(seed: int) -> None:
    torch.default_generator.manual_seed(seed)  # not torch.manual_seed: it visits every accelerator


def _seed_numpy(seed: int) -> None:
    np.random.seed(seed & 0xFFFFFFFF)  # the legacy global generator takes 32 bits


def _seed_python(seed: int) -> None:
    random.seed(seed & 0xFFFFFFFF)  # a third faster than from 64 bits


# name: (seeds it, reads its state, puts a state back)
GENERATORS: dict[str, tuple[Callable[[int], None], Callable[[], Any], Callable[[Any], Any]]] = {
    "torch": (_seed_torch, torch.default_generator.get_state, torch.default_generator.set_state),
    "random": (_seed_python, random.getstate, random.setstate),
    "numpy": (_seed_numpy, np.random.get_state, np.random.set_state),
}


def _same(a, b) -> bool:
    """Two states of one generator are equal (numpy's hold an array, torch's a tensor)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and len(a) == len(b):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


class PerSampleSeed(Dataset):
    """`dataset[i]`, read under a seed of (seed, epoch, i); keys are `(epoch, i)`, a bare `i` reads epoch 0.

    `seeded` names the generators seeded before each item: torch's always (unless the dataset fetches
    whole batches with nothing random drawn), Python's `random` and numpy's where reading draws from them."""

    def __init__(self, dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.whole_batches = batched(dataset)
        self.seeded = [] if self.whole_batches else ["torch", *self._drawn_from()]

    def _drawn_from(self) -> list[str]:
        """Python's `random` and numpy's global generator, where reading a few samples moved their state."""
        n, moved = len(self.dataset), set()
        probes = min(PROBES, n)
        with self._keeping(list(GENERATORS)):
            for index in (i * n // probes for i in range(probes)):
                _seed_torch(sample_seed(self.seed, 0, index))
                before = {name: GENERATORS[name][1]() for name in ("random", "numpy")}
                self.dataset[index]
                moved |= {name for name, state in before.items() if not _same(state, GENERATORS[name][1]())}
        return [name for name in ("random", "numpy") if name in moved]

    @staticmethod
    @contextmanager
    def _keeping(names: list[str]):
        with ExitStack() as stack:
            for name in names:
                stack.enter_context(kept(*GENERATORS[name][1:]))
            yield

    def __len__(self) -> int:
        return len(self.dataset)

    def _read(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        seed = sample_seed(self.seed, epoch, index)
        for name in self.seeded:
            GENERATORS[name][0](seed)
        return self.dataset[index]

    def __getitem__(self, key):
        with self._keeping(self.seeded):
            return self._read(key)

    def __getitems__(self, keys: list):
        if self.whole_batches:  # nothing random is drawn: one indexing op for the batch, as before
            return self.dataset.__getitems__([k[1] if isinstance(k, tuple) else k for k in keys])
        with self._keeping(self.seeded):  # kept once per batch, not per item
            return [self._read(k) for k in keys]


def batched(dataset) -> bool:
    """Whether `dataset` (through Subsets) fetches whole batches without drawing anything random: the image
    cache without augmentation, a Hugging Face dataset without a set_transform."""
    while dataset is not None:
        if hasattr(dataset, "batched"):
            return bool(dataset.batched)
        fmt = getattr(dataset, "format", None)
        if isinstance(fmt, dict) and "type" in fmt and hasattr(dataset, "__getitems__"):
            return fmt["type"] != "custom"
        dataset = getattr(dataset, "dataset", None)
    return False
