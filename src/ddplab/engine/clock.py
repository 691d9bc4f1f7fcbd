"""Evaluation and snapshots clocked apart from training, on the trainer's one continuous clock."""

from __future__ import annotations

import contextlib
import time

import torch


@contextlib.contextmanager
def timed(trainer, activity: str):
    """Adds the block's seconds to state.epoch_<activity>_time (eval, snapshot); the epoch's training time is the
    rest of its wall clock. On CUDA the clock starts once the training work queued before is done, so each
    holds its own device time."""
    if trainer.ctx.device.type == "cuda":
        torch.cuda.synchronize(trainer.ctx.device)  # once per evaluation or snapshot, never per step
    trainer.ctx.beat.mark("evaluation" if activity == "eval" else activity)  # the heartbeat's phase too
    trainer.activity, started = activity, time.perf_counter()
    try:
        yield
    finally:
        name = f"epoch_{activity}_time"
        setattr(trainer.state, name, getattr(trainer.state, name) + time.perf_counter() - started)
        trainer.activity = "train"
        if activity == "snapshot":
            trainer._tick()  # the run's last snapshot has no step after it to tick: its time would miss train_time_s
