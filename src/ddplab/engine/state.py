"""Where a run stands: the progress a snapshot brings back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class TrainState:
    """Everything about progress that a snapshot must bring back."""

    epoch: int = 0  # epochs fully completed
    step: int = 0  # optimizer steps taken
    consumed: int = 0  # samples of the current epoch's global order already trained on
    elapsed: float = 0.0  # seconds inside fit() (training, evaluation, snapshots), across restarts
    best_val_loss: float = math.inf
    best_epoch: int | None = None
    epoch_loss_sum: float = 0.0  # global, for the epoch in progress
    epoch_samples: float = 0.0
    epoch_tokens: float = 0.0
    epoch_time: float = 0.0
    epoch_data_wait: float = 0.0  # seconds this rank waited for its next batch
    history: list = field(default_factory=list)  # one dict per epoch
    steps: list = field(default_factory=list)  # one dict per log interval
    stop_reason: str | None = None  # epochs | max_steps | time_budget | preempted
    resumes: int = 0  # how many times this run was resumed from a snapshot

