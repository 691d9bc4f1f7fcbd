"""A run's progress: what the snapshot's `trainer` part brings back (engine/loop/trainer.py advances it, the clock
adds to its times, the view and metrics.json read it)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


@dataclass
class TrainState:
    """Everything about progress that a snapshot must bring back (the snapshot's `trainer` part)."""

    epoch: int = 0  # epochs fully completed
    step: int = 0  # optimizer steps taken
    consumed: int = 0  # samples of the current epoch's global order already trained on
    elapsed: float = 0.0  # seconds inside fit() (training, evaluation, snapshots), across restarts
    best_val_loss: float = math.inf
    best_epoch: int | None = None
    epoch_loss_sum: float = 0.0  # global, for the epoch in progress
    epoch_loss_weight: float = 0.0  # what epoch_loss_sum is a sum over: the task's items, else samples
    epoch_samples: float = 0.0
    epoch_tokens: float = 0.0
    epoch_time: float = 0.0  # the epoch's wall time so far: training, evaluation and snapshots
    epoch_eval_time: float = 0.0
    epoch_snapshot_time: float = 0.0
    epoch_data_wait: float = 0.0  # seconds this rank waited for its next batch
    history: list = field(default_factory=list)  # one dict per epoch
    steps: list = field(default_factory=list)  # one dict per log interval
    stop_reason: str | None = None  # epochs | max_steps | time_budget | preempted | interrupted | a callback's request
    resumes: int = 0  # how many times this run was resumed from a snapshot
    snapshot_stalls: list = field(default_factory=list)  # {step, stall_s, async}: training held by each snapshot
    epoch_steps: int = 0  # optimizer steps of the epoch in progress
    steps_per_epoch: int | None = None  # a stream's, as its last whole epoch measured it (None: as planned)
    data_notes: list = field(default_factory=list)  # what the data did that was not as planned (metrics.json)

    def epoch_row(self, epoch: int, val: dict, lr: float, data_wait: float) -> dict:
        """The epoch's core row (metrics.csv), from its global sums; its training time is the clock's rest."""
        took = self.epoch_time - self.epoch_eval_time - self.epoch_snapshot_time
        return {
            "epoch": epoch,
            "step": self.step,
            "train_loss": self.epoch_loss_sum / (self.epoch_loss_weight or self.epoch_samples)
            if self.epoch_samples
            else None,
            **{f"val_{k}": v for k, v in val.items() if k != "samples"},
            "epoch_time_s": took,
            "eval_time_s": self.epoch_eval_time,
            "snapshot_time_s": self.epoch_snapshot_time,
            "elapsed_s": self.elapsed,
            "samples_per_s": self.epoch_samples / took if took else None,
            "tokens_per_s": self.epoch_tokens / took if took and self.epoch_tokens else None,
            "lr": lr,
            "data_wait_s": data_wait,
        }

    def next_epoch(self) -> None:
        """A whole epoch is recorded: its sums start over (a stopped epoch keeps them, so that a resumed run
        finishes the same epoch's numbers). The clock runs on: what follows its row (its files, the best model,
        the snapshot) is counted in the next epoch's."""
        self.epoch_loss_sum = self.epoch_loss_weight = self.epoch_samples = self.epoch_tokens = 0.0
        self.epoch_data_wait = self.epoch_time = self.epoch_eval_time = self.epoch_snapshot_time = 0.0
        self.epoch_steps = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(vars(TrainState(**state)))  # in place: the view and the parts hold this object
