"""Experiment trackers (logging.trackers): TensorBoard, MLflow and W&B, fed by rank 0 from the run's own rows.

Each tracker gets the log rows and metrics.csv rows beyond the last step it holds, at their global step, so a
resumed run sends each step once and in order. trackers.json keeps each tracker's run id, so every attempt of a
run continues one MLflow and W&B run. A tracker that fails prints one warning and is dropped.
"""

from __future__ import annotations

from ddplab.callbacks import Callback
from ddplab.engine.run_folder.files import read_json
from ddplab.engine.run_folder.folder import RunFiles, RunFolder
from ddplab.trackers.base import LOG_ROW_SKIP, TensorBoard, numbers
from ddplab.trackers.mlflow_run import MLflow, finish_study
from ddplab.trackers.wandb_run import WandB

BACKENDS = {tracker.name: tracker for tracker in (TensorBoard, MLflow, WandB)}
__all__ = ["BACKENDS", "Trackers", "finish_study"]


class Trackers(Callback):
    """Drives the configured trackers; every hook returns at once on ranks other than 0."""

    def __init__(self, names) -> None:
        self.names = list(names)
        self.live: list[list] = []  # [tracker, last train step it holds, last epoch-row step it holds]
        self.record: dict = {}
        self.view = None

    def on_train_start(self, view):
        if not view.is_main or self.view is not None:
            return
        self.view, self.record = view, read_json(view.run.path / RunFolder.TRACKERS)
        study = RunFiles(view.run.path).point() or None
        for name in self.names:
            tracker = BACKENDS[name]()
            try:
                self.live.append([tracker, *tracker.start(view, self.record, study)])
            except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                view.run.log(f"WARNING: tracker {name} is off for this run: {type(exc).__name__}: {exc}")
        if self.record:
            view.run.write_json(RunFolder.TRACKERS, self.record)
        self._push(view)

    def on_snapshot(self, view, path):
        self._each(view, lambda tracker: tracker.flush())

    def on_train_end(self, view, summary):
        self._push(view)
        self.close(summary.get("status", "complete"))

    def close(self, status: str = "failed") -> None:
        """A run that raised never reaches on_train_end: its trackers end here, as failed."""
        self._each(self.view, lambda tracker: tracker.finish(self.view, status))
        self.live = []

    def _push(self, view, *_, **__) -> None:
        """Every tracker gets the log rows and epoch rows beyond those it holds (on_log and on_epoch_end: new rows)."""
        remembered = False
        for entry in list(self.live):
            tracker, train_done, epoch_done = entry
            # In step order across both kinds of row: W&B ignores a step below one it was given.
            rows = sorted(
                [(r["step"], 1, r) for r in view.log_rows if r["step"] > train_done]
                + [(r["step"], 2, r) for r in view.history if r["step"] > epoch_done],
                key=lambda t: t[:2],
            )
            try:
                for step, kind, row in rows:
                    values = numbers(row, LOG_ROW_SKIP) if kind == 1 else numbers(row)
                    tracker.log({f"train/{k}": v for k, v in values.items()} if kind == 1 else values, step)
                    entry[kind] = step
            except Exception as exc:  # noqa: BLE001
                self._drop(view, entry, exc)
                continue
            if tracker.remembers and rows:
                self.record[tracker.name].update(train=entry[1], epoch=entry[2])
                remembered = True
        if remembered:
            view.run.write_json(RunFolder.TRACKERS, self.record)

    on_log = on_epoch_end = _push

    def _each(self, view, call) -> None:
        for entry in list(self.live):
            try:
                call(entry[0])
            except Exception as exc:  # noqa: BLE001
                self._drop(view, entry, exc)

    def _drop(self, view, entry, exc: Exception) -> None:
        view.run.log(
            f"WARNING: tracker {entry[0].name} failed and is off for the rest of this run: {type(exc).__name__}: {exc}"
        )
        self.live.remove(entry)
