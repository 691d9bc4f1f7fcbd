"""ddplab's built-in workloads: plain workload files, named in ddplab.registry."""

from __future__ import annotations

from dataclasses import fields


def sized_by_config(config_class, model_section, **given):
    """A model's config dataclass with every field the run's model section also has (layers, heads,
    dim, ...) read from it, and the rest (those the data decides: vocab_size, num_classes) `given`."""
    shared = {f.name: getattr(model_section, f.name) for f in fields(config_class) if hasattr(model_section, f.name)}
    return config_class(**{**shared, **given})
