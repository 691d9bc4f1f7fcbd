"""ddplab: DDP training with numbers you can trust.

The public interface for your own workloads (nothing heavy is imported until used):

    ddplab.Data, ddplab.Task, ddplab.Classification, ddplab.Regression, ddplab.LanguageModeling,
    ddplab.Shards (a stream from shard files, resumable at any world size),
    ddplab.Callback (its hooks get a read-only ddplab.TrainView), ddplab.EarlyStopping,
    ddplab.train(config=None, overrides=(), model=None, data=None, callbacks=())

Every name here, and the rule for changing one, is listed in the docs' "Public API" page.
"""

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
