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


class Stamps:
    """Moments on this rank's clock for the step's parts (forward, backward, all-reduce). On CPU the host's
    perf_counter, exact there because nothing runs ahead of the host. On CUDA, events recorded in the current
    stream, so a moment is when the device got there, not when the host queued the work; the seconds between
    two are read once both events have completed (query(), never a sync), which the log interval's sync and
    the epoch's make sure of."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # in the current stream: the autograd engine's and a comm future's callback set theirs
        return event

    def ready(self, *stamps) -> bool:
        return not self.cuda or all(s.query() for s in stamps)

    def seconds(self, start, *ends) -> list[float]:
        """Seconds from `start` to each of `ends`, all of them ready and none before `start`."""
        if not self.cuda:
            return [end - start for end in ends]
        return [start.elapsed_time(end) / 1000 for end in ends]
