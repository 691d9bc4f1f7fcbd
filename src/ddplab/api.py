"""`ddplab.train()`: what `ddplab train` does, from Python, under `python`, `torchrun` or `srun`; inside a Ray
Train worker it trains in the process group Ray made and reports each complete snapshot to Ray."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from ddplab.callbacks import Callback
from ddplab.commands.run import train as run_train
from ddplab.config import Config
from ddplab.engine.loop.parts import Builders
from ddplab.registry import load_config
from ddplab.runtime import process_state


def train(
    config: str | Path | dict | Config | None = None,
    overrides=(),
    *,
    model: Callable | None = None,
    data: Callable | None = None,
    callbacks=(),
    builders: Builders | None = None,
) -> dict:
    """Train and return the run's summary (what metrics.json holds). `model(cfg, data)` and `data(cfg)` take the
    place of model.name / data.name: define them at the top level of a file, as predict, generate and resume
    import it again. `builders` replace how the trainer's parts are built (engine/loop/parts.py)."""
    with process_state.changes():  # importing a workload file puts its folder on sys.path: undone too
        cfg = load_config(config, list(overrides), model=model, data=data)
        callbacks = [*callbacks, *_ray_train()]
        return run_train(cfg, data_fn=data, model_fn=model, callbacks=callbacks, builders=builders)


def _ray_train() -> list[Callback]:
    """In a Ray Train worker, the callback that reports snapshots to Ray; elsewhere none. Ray is imported only
    where a Ray Train worker has imported it already."""
    if "ray.train" not in sys.modules:
        return []
    import ray.train  # already loaded by the Ray worker that runs this

    try:
        ray.train.get_context()
    except RuntimeError:  # Ray, but not inside a training function
        return []
    return [RayReport()]


class RayReport(Callback):
    """Each complete snapshot, reported to Ray Train (every rank calls it; rank 0 hands the snapshot folder as the
    Checkpoint): after FailureConfig restarts the group, ddplab resumes from its run folder."""

    def on_snapshot(self, view, path) -> None:
        import ray.train  # only in a Ray worker, which has loaded it

        checkpoint = ray.train.Checkpoint.from_directory(str(path)) if path is not None else None
        metrics = {"step": view.step, "epoch": view.epochs_completed, "run": str(view.run.path)}
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=f"ddplab-step-{view.step:09d}")
