"""`ddplab.train()`: what `ddplab train` does, from Python, with your functions and callbacks.

The same script runs as `python script.py`, `torchrun --nproc-per-node=N script.py` and
`srun python script.py`: every process calls train(), which reads the launcher's environment.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ddplab import process_state
from ddplab.config import Config
from ddplab.engine.parts import Builders
from ddplab.registry import load_config
from ddplab.run import train as run_train


def train(
    config: str | Path | dict | Config | None = None,
    overrides=(),
    *,
    model: Callable | None = None,
    data: Callable | None = None,
    callbacks=(),
    builders: Builders | None = None,
) -> dict:
    """Train and return the run's summary (what metrics.json holds; "status" is "complete" or
    "preempted"). `model(cfg, data)` and `data(cfg)` take the place of model.name / data.name;
    define them at the top level of a file guarded by `if __name__ == "__main__":`, since
    predict, generate and resume import that file again. `builders` replace how the trainer's parts are
    built (engine/parts.py)."""
    with process_state.changes():  # importing a workload file puts its folder on sys.path: undone too
        cfg = load_config(config, list(overrides), model=model, data=data)
        return run_train(cfg, data_fn=data, model_fn=model, callbacks=list(callbacks), builders=builders)
