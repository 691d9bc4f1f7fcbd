"""Callbacks: what happens around the loop without being the loop.

The trainer only steps, accumulates, evaluates and stops; it calls these hooks at fixed
points, on every rank, in list order. ddplab's own progress bar, console lines, metrics files,
TensorBoard, MFU / communication / GPU columns and the test-only fault injection are callbacks;
user callbacks go through the same hooks (`ddplab.train(callbacks=[...])`).

A hook gets the trainer: `trainer.state` (a TrainState: epoch, step, consumed, history...),
`trainer.cfg`, `trainer.ctx` (rank, world size, device), `trainer.model` / `trainer.raw`,
`trainer.optimizer`, `trainer.run` (the run folder). Treat the state as read-only: a callback
that changes it breaks exact resume. Hooks run on every rank; a hook that calls a collective
must do so on all ranks, and one that writes files should check `trainer.ctx.is_main`.
"""

from __future__ import annotations


class Callback:
    def on_train_start(self, trainer) -> None:
        """After resuming, before the first step of this attempt."""

    def on_epoch_start(self, trainer) -> None:
        """Before the first step of an epoch (or of its rest, after a resume)."""

    def on_step_end(self, trainer) -> None:
        """After each optimizer step (trainer.state.step is the step just taken)."""

    def on_log(self, trainer, values: dict) -> None:
        """At each log interval: the global train loss and learning rate since the last one."""

    def on_eval_end(self, trainer, split: str, metrics: dict) -> None:
        """After a global evaluation of `split` (val, test)."""

    def on_epoch_end(self, trainer, row: dict) -> None:
        """An epoch's row (also a partial one, row["partial"]): add columns here; it is then recorded."""

    def on_snapshot_saving(self, trainer, step: int) -> None:
        """Rank 0, while a snapshot is written: its data is on disk, its COMPLETE marker not yet."""

    def on_snapshot(self, trainer, path) -> None:
        """After a snapshot is complete (path: its folder on rank 0, None elsewhere)."""

    def on_train_end(self, trainer, summary: dict) -> None:
        """After the run, with what metrics.json holds."""


HOOKS = [name for name in vars(Callback) if name.startswith("on_")]


class CallbackList:
    """Calls a hook on each callback in order: `callbacks.on_step_end(trainer)`."""

    def __init__(self, callbacks) -> None:
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                from ddplab.errors import UserError

                raise UserError(f"callbacks: {cb!r} is not a ddplab.Callback (subclass ddplab.Callback)")

    def __getattr__(self, hook: str):
        if hook not in HOOKS:
            raise AttributeError(hook)

        def call(*args, **kwargs) -> None:
            for cb in self.callbacks:
                getattr(cb, hook)(*args, **kwargs)
        return call
