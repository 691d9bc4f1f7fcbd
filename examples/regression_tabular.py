"""Your own regression workload: scikit-learn's diabetes data (442 patients, 10 features; it
ships with scikit-learn, nothing is downloaded) and a small MLP.

    ddplab train model.name=examples/regression_tabular.py:model data.name=examples/regression_tabular.py:data \
        training.epochs=30 training.batch_size=16 training.lr=3e-3 training.warmup_steps=0
    ddplab predict experiments/regression_tabular.model-regression_tabular.data 0.04,0.05,0.06,0.02,-0.04,-0.03,-0.04,0,0.02,-0.02
"""

import torch
from torch.utils.data import TensorDataset

import ddplab


def data(cfg):
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(cfg.options.get("split_seed", 0)))
    n_val = int(len(x) * cfg.options.get("val_fraction", 0.2))
    val, train = order[:n_val], order[n_val:]
    # Standardise with the training split's statistics only.
    mean, std = x[train].mean(0), x[train].std(0)
    y_mean, y_std = y[train].mean(), y[train].std()
    x, y = (x - mean) / std, (y - y_mean) / y_std
    return ddplab.Data(train=TensorDataset(x[train], y[train]), val=TensorDataset(x[val], y[val]),
                       task=ddplab.Regression(), meta={"target_mean": y_mean.item(), "target_std": y_std.item()})


def model(cfg, data):
    hidden = cfg.options.get("hidden", 32)
    return torch.nn.Sequential(torch.nn.Linear(10, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
