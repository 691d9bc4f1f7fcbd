"""Test-only fault injection, read from the environment variable DDPLAB_FAULT.

The fault-tolerance tests use it to make a failure happen at an exact point of a real run.
Unset (always, outside tests) every hook below is a no-op. The value is comma-separated
`key=value` items; `step=S` says when (after optimizer step S, counted over the whole run):

  kill_rank=R,step=S      rank R sends itself SIGKILL (a worker that dies without a word)
  raise_rank=R,step=S     rank R raises RuntimeError (an ordinary crash)
  hang_rank=R,step=S      rank R stops taking part (sleeps until SIGTERM/SIGKILL ends it)
  signal_rank=R,step=S    rank R sends itself SIGUSR1 (or sig=TERM: SIGTERM), as SLURM does
                          before pre-emption
  nan_rank=R,step=S       rank R's loss of step S becomes NaN
  crash_before_marker=S   rank 0 dies after writing snapshot S's data, before its COMPLETE marker
  trace=DIR               each rank appends "epoch index" for every sample it trains on to
                          DIR/rank<R>.txt (exact with data.num_workers=0, the default on CPU)

Faults fire only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT=0), so
a job restarted by `--max-restarts` runs clean; `trace` records in every attempt.

It is a callback like any other: the loop and the checkpointer do not know it exists.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from torch.utils.data import Sampler

from ddplab.engine.callbacks import Callback

ENV = "DDPLAB_FAULT"


class Faults(Callback):
    def __init__(self, spec: str, rank: int, first_attempt: bool) -> None:
        self.items = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
        self.rank = rank
        self.armed = first_attempt

    def _fires(self, kind: str, step: int) -> bool:
        return (self.armed and f"{kind}_rank" in self.items and int(self.items[f"{kind}_rank"]) == self.rank
                and int(self.items.get("step", -1)) == step)

    # -- hooks ------------------------------------------------------------------------
    def on_train_start(self, trainer) -> None:
        if "trace" in self.items:
            trainer.loader_sampler = self.traced(trainer.sampler)
        if "nan_rank" in self.items:
            task_loss = trainer.task.loss

            def loss(output, target):  # the loss of the step being taken (state.step + 1)
                return self.loss(task_loss(output, target), trainer.state.step + 1)
            trainer.loss_fn = loss

    def on_step_end(self, trainer) -> None:
        self.after_step(trainer.state.step)

    def on_snapshot_saving(self, trainer, step: int) -> None:
        self.before_marker(step)

    # -- faults -------------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        if self._fires("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fires("raise", step):
            raise RuntimeError(f"injected fault on rank {self.rank} after step {step}")
        if self._fires("signal", step):
            os.kill(os.getpid(), signal.Signals["SIG" + self.items.get("sig", "USR1")])
        if self._fires("hang", step):
            # A stuck rank: it ignores the job, but the launcher's SIGTERM still ends it.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(60)

    def loss(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        return loss * float("nan") if self._fires("nan", step) else loss

    def before_marker(self, step: int) -> None:
        if self.armed and int(self.items.get("crash_before_marker", -1)) == step:
            os.kill(os.getpid(), signal.SIGKILL)

    def traced(self, sampler):
        """The sampler itself, or one that also logs every index it hands out."""
        if "trace" not in self.items:
            return sampler
        path = Path(self.items["trace"]) / f"rank{self.rank}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        return _TracedSampler(sampler, path)


class _TracedSampler(Sampler[int]):
    def __init__(self, sampler, path: Path) -> None:
        self.sampler, self.path = sampler, path

    def __iter__(self):
        with open(self.path, "a", buffering=1) as f:
            for index in self.sampler:
                f.write(f"{self.sampler.epoch} {index}\n")
                yield index

    def __len__(self) -> int:
        return len(self.sampler)


def from_environment() -> list[Faults]:
    """The fault callback when DDPLAB_FAULT is set (tests only); nothing otherwise."""
    spec = os.environ.get(ENV, "")
    if not spec:
        return []
    return [Faults(spec, int(os.environ.get("RANK", "0")), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")]
