"""Random augmentation drawn from a per-sample seed, so that a sample is augmented the same whatever the
world size, the worker count or the point a run resumed from.

`PerSampleSeed` wraps a map-style training set. The training sampler hands it `(epoch, index)` keys
(`ResumableDistributedSampler.keyed`); each item is read with torch's CPU generator seeded from
(experiment.seed, epoch, index), and the generator is put back afterwards, so training's own draws
(dropout) are untouched. torchvision's transforms (v1 and v2) draw from torch's generator, so they
become a function of the sample. Python's `random` and numpy's global generator are not seeded: saving
and restoring them costs 70 and 370 us an item, several times a small CNN's step on digits. Streams
(IterableDataset) are not wrapped: a stream has no index to seed from, and keeps each rank's own draws.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils.data import Dataset

MASK = (1 << 64) - 1


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A seed for one sample of one epoch: splitmix64's finaliser over the three, so neighbouring samples'
    streams are unrelated (a tenth of hashlib's time; torch's generator keeps the low 32 bits)."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


@contextmanager
def kept_generator():
    """torch's CPU generator as it was before, whatever was drawn or seeded inside."""
    generator = torch.default_generator
    state = generator.get_state()
    try:
        yield generator
    finally:
        generator.set_state(state)


class PerSampleSeed(Dataset):
    """`dataset[i]`, read under a seed of (seed, epoch, i); keys are `(epoch, i)`, a bare `i` reads epoch 0."""

    def __init__(self, dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.whole_batches = batched(dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def _read(self, generator, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        generator.manual_seed(sample_seed(self.seed, epoch, index))  # not torch.manual_seed: it visits every accelerator
        return self.dataset[index]

    def __getitem__(self, key):
        with kept_generator() as generator:
            return self._read(generator, key)

    def __getitems__(self, keys: list):
        if self.whole_batches:  # nothing random is drawn: one indexing op for the batch, as before
            return self.dataset.__getitems__([k[1] if isinstance(k, tuple) else k for k in keys])
        with kept_generator() as generator:  # saved once per batch, not per item
            return [self._read(generator, k) for k in keys]


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
