"""ddplab: DDP training with numbers you can trust. The names below, and the rule for changing one, are listed
in the docs' "Public API" page; nothing heavy is imported until a name is used."""

from __future__ import annotations

import importlib

# Read by pyproject.toml (the package's version) without importing ddplab: keep it a plain string.
__version__ = "0.2.0"

_PUBLIC = {
    "Data": "ddplab.workload",
    "BuildConfig": "ddplab.workload",
    "Assets": "ddplab.workload",
    "Task": "ddplab.tasks",
    "Classification": "ddplab.tasks",
    "Regression": "ddplab.tasks",
    "LanguageModeling": "ddplab.tasks",
    "Callback": "ddplab.callbacks",
    "EarlyStopping": "ddplab.callbacks",
    "TrainView": "ddplab.engine.loop.view",
    "Shards": "ddplab.data.shards",
    "train": "ddplab.api",
    "UserError": "ddplab.errors",
    "ExitCode": "ddplab.errors",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ddplab' has no attribute '{name}'")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
