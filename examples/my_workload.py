"""The README's workload: a regression on tensors it makes itself (needs only the core install).

    ddplab train model.name=examples/my_workload.py:model data.name=examples/my_workload.py:data \
        model.options.hidden=64 training.epochs=10 training.warmup_steps=0 --nproc-per-node 2
"""

import torch
from torch.utils.data import TensorDataset

import ddplab


def data(cfg):  # cfg.options: data.options.*; also cfg.config, cfg.rank, cfg.world_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(512, generator=g)
    return ddplab.Data(train=TensorDataset(x[:448], y[:448]), val=TensorDataset(x[448:], y[448:]),
                       task=ddplab.Regression())


def model(cfg, data):  # cfg.options: model.options.*; data: what data() returned
    hidden = cfg.options.get("hidden", 32)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
