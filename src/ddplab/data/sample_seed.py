"""Random augmentation drawn from a per-sample seed, so that a sample is augmented the same whatever the
world size, the worker count or the point a run resumed from.

`PerSampleSeed` wraps a map-style training set read with `(epoch, index)` keys
(`ResumableDistributedSampler.keyed`): each item is read with torch's CPU generator seeded from
(experiment.seed, epoch, index), and Python's `random` and numpy's global generator too where reading draws
from them. The callers' generators are put back after each batch, so training's own draws are untouched.

Seeding costs an item (a 2-core host) about 1 us for torch, 1.5 us for numpy, 4 us for Python. So Python's
and numpy's are seeded only where reading a few samples, when the dataset is wrapped, moved their state (the
same samples under the same seeds in every process, so every world size decides alike). numpy's state is
kept through its C struct (`_numpy_state`): get_state and set_state cost 30-40 us each, more than seeding a
whole batch. Streams are not wrapped: they have no index to seed from.
"""

from __future__ import annotations

import ctypes
import pickle
import random
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from numpy.random import mtrand
from torch.utils.data import Dataset

PROBES = 16  # samples read when a dataset is wrapped, to see which generators reading draws from
KEY = 624 * 4  # bytes of numpy's MT19937 words; its int position follows them in the C struct


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A seed below 2**32 for one sample of one epoch: distinct for every sample of an epoch and for one
    sample over its epochs; two samples share one only in epochs far apart (for ImageNet's 1.28 M samples,
    1,470 or more). No mixing here: each generator's own seeding (MT19937's initialisation) makes
    neighbouring seeds' streams unrelated, and a splitmix64 finaliser cost a quarter of seeding torch's
    generator. 32 bits is all the generators use: torch's CPU generator keeps the low 32, numpy's legacy
    one takes more only as a list of words (5x the time)."""
    return (seed * 0x9E3779B1 + epoch * 0x85EBCA77 + index) & 0xFFFFFFFF


def _numpy_state() -> tuple[int, bytes, float | None]:
    """numpy's global generator as it stands: the address and bytes of its MT19937 struct (words, then
    position), and the normal it keeps cached, if any. Drawing a normal hands the cached one back without
    touching the words; with none cached it draws new words. Either way the state is put back after."""
    address = mtrand.get_bit_generator().ctypes.state_address
    words = ctypes.string_at(address, KEY + 4)
    cached = np.random.standard_normal()
    return address, words, cached if ctypes.string_at(address, KEY + 4) == words else None


def _set_numpy_state(state: tuple[int, bytes, float | None]) -> None:
    address, words, cached = state
    if cached is None:
        np.random.seed(0)  # drops any normal cached while reading
        ctypes.memmove(address, words, KEY + 4)
    else:  # the caller drew an odd number of normals: only set_state puts a cached one back
        position = int.from_bytes(words[KEY:], sys.byteorder, signed=True)
        np.random.set_state(("MT19937", np.frombuffer(words[:KEY], np.uint32), position, 1, cached))


# name: (seeds it from a seed below 2**32, reads its state, puts a state back)
GENERATORS: dict[str, tuple[Callable[[int], Any], Callable[[], Any], Callable[[Any], Any]]] = {
    # not torch.manual_seed: it visits every accelerator
    "torch": (
        torch.default_generator.manual_seed,
        torch.default_generator.get_state,
        torch.default_generator.set_state,
    ),
    "random": (random.seed, random.getstate, random.setstate),
    "numpy": (np.random.seed, _numpy_state, _set_numpy_state),
}


@contextmanager
def keeping(names: list[str]):
    """The named generators' states as they were before, whatever was drawn or seeded inside."""
    states = [(GENERATORS[name][2], GENERATORS[name][1]()) for name in names]
    try:
        yield
    finally:
        for put, state in states:
            put(state)


class PerSampleSeed(Dataset):
    """`dataset[i]`, read under a seed of (seed, epoch, i); keys are `(epoch, i)`, a bare `i` reads epoch 0.

    `seeded` names the generators seeded before each item: torch's always (unless the dataset fetches
    whole batches with nothing random drawn), Python's `random` and numpy's where reading draws from them."""

    def __init__(self, dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.whole_batches = batched(dataset)
        self.seeded = [] if self.whole_batches else ["torch", *self._drawn_from()]

    def _drawn_from(self) -> list[str]:
        """Python's `random` and numpy's global generator, where reading a few samples moved their state
        (read by their own getters here: `_numpy_state` draws, so it cannot watch for a draw)."""
        n, moved = len(self.dataset), set()
        probes = min(PROBES, n)
        # numpy's state holds an array, so it is compared as its pickled bytes.
        watched = {"random": random.getstate, "numpy": lambda: pickle.dumps(np.random.get_state())}
        with keeping(list(GENERATORS)):
            for index in (i * n // probes for i in range(probes)):
                torch.default_generator.manual_seed(sample_seed(self.seed, 0, index))
                before = {name: state() for name, state in watched.items()}
                self.dataset[index]
                moved |= {name for name, state in watched.items() if before[name] != state()}
        return [name for name in watched if name in moved]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        return self._read([key])[0]

    def __getitems__(self, keys: list):
        if self.whole_batches:  # nothing random is drawn: one indexing op for the batch, as before
            return self.dataset.__getitems__([_key(k)[1] for k in keys])
        return self._read(keys)

    def _read(self, keys: list) -> list:
        seeders = [GENERATORS[name][0] for name in self.seeded]
        items = []
        with keeping(self.seeded):  # kept once per batch, not per item
            for key in keys:
                epoch, index = _key(key)
                seed = sample_seed(self.seed, epoch, index)
                for seeding in seeders:
                    seeding(seed)
                items.append(self.dataset[index])
        return items


def _key(key) -> tuple[int, int]:
    return key if isinstance(key, tuple) else (0, key)


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
