"""Experiment trackers (logging.trackers): TensorBoard, MLflow and W&B, fed from the run's own rows.

Rank 0 alone talks to a tracker. Each gets the rows the run itself keeps: every log interval's
training row (view.log_rows, as train/loss and train/lr at its step) and every metrics.csv row
(view.history, its columns by name at the row's global step). Rows are pushed from that history
beyond the last step the tracker already holds, so a resumed run, which replays the steps between
its last snapshot and the crash, sends each step once and in order; a tracker added on resume, or
one that lost rows in a crash, is sent the rows it lacks from the snapshot's history.

A run folder's trackers.json holds each tracker's run id, so every attempt of a run (kill,
pre-emption, elastic restart, another world size) continues the same MLflow and W&B run. A study
point (study_point.json beside its run files) becomes a child of its study's MLflow run, whose id
the study folder's trackers.json holds. A tracker that fails prints one warning and is dropped:
training goes on and nothing in the run folder depends on it.
"""

from __future__ import annotations

from ddplab.engine.callbacks import Callback
from ddplab.engine.run_folder import RunFolder
from ddplab.trackers.base import LOG_ROW_SKIP, POINT_FILE, TensorBoard, numbers, read_json
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
        self.started = False
        self.view = None

    def on_train_start(self, view):
        if not view.is_main or self.started:
            return
        self.started, self.view = True, view
        self.record = read_json(view.run.path / RunFolder.TRACKERS)
        study = read_json(view.run.path / POINT_FILE) or None
        for name in self.names:
            tracker = BACKENDS[name]()
            try:
                self.live.append([tracker, *tracker.start(view, self.record, study)])
            except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                view.run.log(f"WARNING: tracker {name} is off for this run: {type(exc).__name__}: {exc}")
        if self.record:
            view.run.write_json(RunFolder.TRACKERS, self.record)
        self._push(view)

    def on_log(self, view, values):
        self._push(view)

    def on_epoch_end(self, view, row):
        self._push(view)

    def on_snapshot(self, view, path):
        self._each(view, lambda tracker: tracker.flush())

    def on_train_end(self, view, summary):
        self._push(view)
        self._each(view, lambda tracker: tracker.finish(view, summary.get("status", "complete")))
        self.live = []

    def close(self) -> None:
        """A run that raised never reaches on_train_end: its trackers end here, as failed."""
        self._each(self.view, lambda tracker: tracker.finish(self.view, "failed"))
        self.live = []

    def _push(self, view) -> None:
        if not self.live:
            return
        log_rows, history, remembered = view.log_rows, view.history, False
        for entry in list(self.live):
            tracker, train_done, epoch_done = entry
            # In step order across both kinds of row: W&B ignores a step below one it was given.
            rows = sorted([(r["step"], 1, r) for r in log_rows if r["step"] > train_done]
                          + [(r["step"], 2, r) for r in history if r["step"] > epoch_done], key=lambda t: t[:2])
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

    def _each(self, view, call) -> None:
        for entry in list(self.live):
            try:
                call(entry[0])
            except Exception as exc:  # noqa: BLE001
                self._drop(view, entry, exc)

    def _drop(self, view, entry, exc: Exception) -> None:
        view.run.log(f"WARNING: tracker {entry[0].name} failed and is off for the rest of this run: "
                     f"{type(exc).__name__}: {exc}")
        self.live.remove(entry)
