"""A workload for tests/test_shards.py: ddplab.Shards over Parquet shards of rows {idx} in
data.options.path, and a linear model that writes the idx of every training sample it sees."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import ddplab


def features(row: dict) -> dict:
    """A sample made from its idx alone: 4 numbers, their sign as the label."""
    x = torch.randn(4, generator=torch.Generator().manual_seed(row["idx"]))
    return {"x": x, "labels": int(x.sum() > 0), "idx": row["idx"]}


def shards_data(cfg):
    train = ddplab.Shards(cfg.options.path, seed=cfg.config.experiment.seed, window=8, transform=features)
    val = ddplab.Shards(cfg.options.path, shuffle=False, transform=features)
    return ddplab.Data(train=train, val=val, task=ddplab.Classification(2))


class Recorder(torch.nn.Module):
    """Appends the idx of each training batch, one line a forward pass, to
    <options.log>/<rank>.<torchrun restart>.<pid>."""

    def __init__(self, log: str) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.log = Path(log)

    def forward(self, x, labels=None, idx=None):
        if self.training and torch.is_grad_enabled():
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            with open(self.log / f"{rank}.{restart}.{os.getpid()}", "a") as f:
                f.write(" ".join(str(int(i)) for i in idx) + "\n")
        return self.linear(x)


def recorder(cfg, data):
    torch.manual_seed(0)
    return Recorder(cfg.options.log)
