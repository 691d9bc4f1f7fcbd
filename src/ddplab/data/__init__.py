"""Built-in data sources (declared in ddplab.registry): each builds a DataBundle from the config."""

from __future__ import annotations


def build_data(cfg, ctx):
    """The built-in source `data.name` names, as the Data every workload returns."""
    from ddplab.registry import as_data, data_spec

    return as_data(data_spec(cfg.data.name).load()(cfg, ctx))
