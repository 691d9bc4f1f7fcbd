"""`ddplab.train()`: what `ddplab train` does, from Python, with your functions and callbacks.

The same script runs as `python script.py`, `torchrun --nproc-per-node=N script.py` and
`srun python script.py`: every process calls train(), which reads the launcher's environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ddplab.config import Config, apply_override, from_dict, load_config as load_typed, validate


def train(config: str | Path | dict | Config | None = None, overrides=(), *, model: Callable | None = None,
          data: Callable | None = None, callbacks=()) -> dict:
    """Train and return the run's summary (what metrics.json holds; "status" is "complete" or
    "preempted"). `model(cfg, data)` and `data(cfg)` take the place of model.name / data.name;
    define them at the top level of a file guarded by `if __name__ == "__main__":`, since
    predict, generate and resume import that file again."""
    from ddplab import registry
    from ddplab.run import train as run_train
    from ddplab.workload import reference_of, resolve

    cfg = _config(config, list(overrides))
    if model is not None:
        cfg.model.name = reference_of(model)
    if data is not None:
        cfg.data.name = reference_of(data)
    # Names are checked as on the command line; a function handed in here is not imported again.
    if model is None and data is None:
        registry.check_config(cfg)
    elif model is None:
        registry.model_builder(cfg.model.name)
    elif data is None and registry.data_spec(cfg.data.name) is None:
        resolve(cfg.data.name, "data.name")
    registry.absolute_references(cfg)
    return run_train(cfg, data_fn=data, model_fn=model, callbacks=list(callbacks))


def _config(config, overrides: list[str]) -> Config:
    if config is None or isinstance(config, (str, Path)):
        return load_typed(config, overrides)
    if isinstance(config, Config):
        cfg = from_dict(config.to_dict())
    elif isinstance(config, dict):
        cfg = from_dict(config)
    else:
        from ddplab.errors import UserError

        raise UserError(f"config: give a YAML path, a dict, a ddplab Config or None; got {type(config).__name__}")
    for item in overrides:
        apply_override(cfg, item)
    validate(cfg)
    return cfg
