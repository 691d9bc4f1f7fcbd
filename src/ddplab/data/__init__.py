"""Built-in data sources (declared in ddplab.registry): each builds a DataBundle from the config."""

from __future__ import annotations


def build_data(cfg, ctx):
    """The built-in source `data.name` names, as the Data every workload returns."""
    from torch.utils.data import Subset

    from ddplab.registry import as_data, data_spec

    data = as_data(data_spec(cfg.data.name).load()(cfg, ctx))
    if cfg.data.limit is not None and cfg.data.limit < len(data.train):
        data.train = Subset(data.train, range(cfg.data.limit))
    return data
