"""A run's progress: what the snapshot's `trainer` part brings back (engine/trainer.py advances it, the clock
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

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(vars(TrainState(**state)))  # in place: the view and the parts hold this object
