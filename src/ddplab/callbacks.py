"""The hooks a callback is written against (docs/your-workload.md#callbacks), and EarlyStopping. Each hook is
called on every rank, in list order, with a read-only `ddplab.TrainView`; a callback's `state_dict()` is saved
in every snapshot and restored on resume."""

from __future__ import annotations

import math

from ddplab.errors import RunError, UserError


class Callback:
    def on_train_start(self, view) -> None:
        """After resuming, before the first step of this attempt."""

    def on_epoch_start(self, view) -> None:
        """Before the first step of an epoch (or of its rest, after a resume)."""

    def on_step_end(self, view) -> None:
        """After each optimizer step (view.step is the step just taken)."""

    def on_log(self, view, values: dict) -> None:
        """At each log interval: the global train loss and learning rate since the last one."""

    def on_eval_end(self, view, split: str, metrics: dict) -> None:
        """After a global evaluation of `split` (val, test)."""

    def on_epoch_end(self, view, row: dict) -> None:
        """An epoch's row (also a partial one, row["partial"]): add columns here; it is then recorded."""

    def on_snapshot(self, view, path) -> None:
        """After a snapshot is complete (path: its folder on rank 0, None elsewhere)."""

    def on_train_end(self, view, summary: dict) -> None:
        """After the run, with what metrics.json holds."""


class EarlyStopping(Callback):
    """End the run when `monitor` (a column of the epoch rows) has not improved by more than `min_delta` for
    `patience` whole epochs; decided from the row every rank holds alike, each decision logged."""

    def __init__(self, monitor: str = "val_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise UserError(f"EarlyStopping(mode={mode!r}): choose min or max")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise UserError(f"EarlyStopping(patience={patience!r}): needs an integer >= 1")
        if not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise UserError(f"EarlyStopping(min_delta={min_delta!r}): needs a number >= 0")
        self.monitor, self.mode, self.patience, self.min_delta = monitor, mode, patience, float(min_delta)
        self.best = math.inf if mode == "min" else -math.inf
        self.best_epoch: int | None = None
        self.wait = 0  # whole epochs since the last improvement
        self.stopped_epoch: int | None = None

    def on_epoch_end(self, view, row: dict) -> None:
        if row.get("partial"):  # part of an epoch is not an epoch of patience
            return
        value = row.get(self.monitor)
        if value is None:
            columns = ", ".join(k for k, v in row.items() if isinstance(v, (int, float)) and k != "epoch")
            raise RunError(
                f"EarlyStopping: epoch {row['epoch']}'s row has no {self.monitor} (no validation split?); "
                f"monitor one of: {columns}"
            )
        epoch, lower = row["epoch"], self.mode == "min"
        bound = self.best - self.min_delta if lower else self.best + self.min_delta
        said = f"early stopping: epoch {epoch} {self.monitor} {value:.6g}"
        compared = (
            f"{'<' if lower else '>'} {bound:.6g} (best {self.best:.6g} of epoch {self.best_epoch}, "
            f"min_delta {self.min_delta:g})"
        )
        if value < bound if lower else value > bound:
            view.run.log(f"{said} {compared}: improved")
            self.best, self.best_epoch, self.wait = value, epoch, 0
            return
        self.wait += 1
        view.run.log(f"{said} is not {compared}: {self.wait}/{self.patience} epochs without improvement")
        if self.wait >= self.patience:
            self.stopped_epoch = epoch
            view.run.log(
                f"early stopping: stop after epoch {epoch}; best {self.monitor} {self.best:.6g} "
                f"of epoch {self.best_epoch}"
            )
            view.request_stop("early_stopping")

    STATE = ("best", "best_epoch", "wait", "stopped_epoch")  # what a snapshot keeps

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.STATE}

    def load_state_dict(self, state: dict) -> None:
        for name in self.STATE:
            setattr(self, name, state[name])


def configured(t) -> list[Callback]:
    """The callbacks the training section `t` asks for: training.early_stopping.* (monitor set)."""
    e = t.early_stopping
    return [EarlyStopping(e.monitor, e.mode, e.patience, e.min_delta)] if e.monitor else []
