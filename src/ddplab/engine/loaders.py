"""DataLoaders for training and evaluation: worker counts, pinning, and their own generators."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader

from ddplab.data.sampler import ShardSampler


def data_workers(requested: int | None, device: torch.device, processes_per_node: int) -> int:
    """data.num_workers, or by default none on CPU (the ranks already use every core) and, on CUDA, every
    core this rank may use but one, kept for the training process: decoding images is what keeps a GPU
    waiting, and a fixed 4 workers left a 16-core host's GPU idle half of each epoch."""
    if requested is not None:
        return requested
    if device.type != "cuda":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, cores // processes_per_node - 1)


class Loaders:
    def __init__(self, cfg, ctx, collate_fn) -> None:
        self.cfg, self.ctx, self.collate_fn = cfg, ctx, collate_fn
        self.workers = data_workers(cfg.data.num_workers, ctx.device, ctx.launch.local_world_size)
        self._eval: dict[int, DataLoader] = {}

    def _make(self, dataset, sampler, **extra) -> DataLoader:
        return DataLoader(dataset, batch_size=self.cfg.training.batch_size, sampler=sampler,
                          collate_fn=self.collate_fn, num_workers=self.workers, persistent_workers=self.workers > 0,
                          pin_memory=self.cfg.data.pin_memory and self.ctx.device.type == "cuda", **extra)

    def train(self, dataset, sampler) -> DataLoader:
        # Its own generator: creating an iterator must not consume the global RNG, or a run
        # resumed mid-epoch would draw different dropout masks than an unbroken one.
        return self._make(dataset, sampler, generator=torch.Generator().manual_seed(self.cfg.experiment.seed))

    def evaluation(self, dataset) -> DataLoader:
        """One loader per split, kept: its workers persist instead of starting at every evaluation."""
        if id(dataset) not in self._eval:
            self._eval[id(dataset)] = self._make(dataset, ShardSampler(len(dataset), self.ctx.rank, self.ctx.world_size))
        return self._eval[id(dataset)]
