"""Where a run's wall time goes before, around and after training: one mark per phase.

`imports_s` reaches back to the process's creation (from /proc); `launcher_s` runs from the start of `ddplab train
--nproc-per-node` to the worker's creation (where the agent forks its workers, torch's import is counted there).
The first optimizer step (DDP's first iteration builds its buckets) is split off the rest of training, and under
training.compile the time torch.compile spends compiling (dynamo's frames, the lazy backward) is `compile_s`.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from ddplab.engine.parallel.torch_internals import compile_callbacks
from ddplab.engine.run_folder.folder import amend
from ddplab.errors import RunError
from ddplab.runtime.handoff import Handoff


def process_started_at() -> float | None:
    """Wall-clock time this process was created, to the kernel's clock tick (10 ms); None off Linux."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22, counted after the command name
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - (since_boot - started_ticks / os.sysconf("SC_CLK_TCK"))


def note_launch() -> None:
    """In the launcher, before it starts workers: they inherit the launcher's start time."""
    started = process_started_at()
    if started is not None:
        os.environ.update(Handoff(launched_at=started).env())


class Phases:
    def __init__(self) -> None:
        now = time.time()
        self.seconds: dict[str, float] = {}
        started = process_started_at()
        if started is not None:
            launched = Handoff.read().launched_at
            if launched is not None:  # started by ddplab's launcher
                self.seconds["launcher_s"] = max(started - launched, 0.0)
            self.seconds["imports_s"] = max(now - started, 0.0)
        self._last = now
        self._first_step_at: float | None = None
        self._compiling = CompileClock()
        self._compiled_by_first_step = 0.0

    def mark(self, name: str) -> None:
        now = time.time()
        if name == "training":
            compiled = self._compiling.stop()
            if self._first_step_at is not None:
                self.seconds["first_step_s"] = self._first_step_at - self._last - self._compiled_by_first_step
                self._last = self._first_step_at
                compiled -= self._compiled_by_first_step
            if self._compiling.seconds:
                self.seconds["compile_s"] = self._compiling.seconds
            self._last += compiled  # the rest of training, without its recompiles
        self.seconds[f"{name}_s"] = self.seconds.get(f"{name}_s", 0.0) + now - self._last
        self._last = now

    def watch_first_step(self, optimizer, compiles: bool = False) -> None:
        """Time the end of the first optimizer step, through a hook that removes itself; with `compiles`,
        time torch.compile's compilations too."""
        if compiles:
            self._compiling.start()

        def hook(*_):
            if self._first_step_at is None:
                self._first_step_at = time.time()
                self._compiled_by_first_step = self._compiling.seconds
            handle.remove()

        handle = optimizer.register_step_post_hook(hook)

    def as_dict(self) -> dict:
        return {**{k: round(v, 3) for k, v in self.seconds.items()}, "total_s": round(sum(self.seconds.values()), 3)}

    def line(self) -> str:
        parts = [f"{k[:-2].replace('_', ' ')} {v:.2f} s" for k, v in self.seconds.items()]
        return "phases (rank 0, wall time): " + ", ".join(parts) + f"; total {sum(self.seconds.values()):.2f} s"

    def add_teardown(self, run_dir: Path) -> None:
        """After the process group is gone: the teardown phase, appended to train.log and metrics.json."""
        self.mark("teardown")
        with contextlib.suppress(OSError, RunError):  # the run itself is recorded; only the breakdown is missing
            amend(run_dir, self.line(), phases=self.as_dict())


class CompileClock:
    """Seconds torch.compile spends compiling, from dynamo's own start / end callbacks (a new frame, a
    recompile, and the backward pass compiled lazily at the first backward)."""

    def __init__(self) -> None:
        self.seconds, self._began = 0.0, 0.0
        self._handler: Any = None  # dynamo's callback handler while hooked

    def start(self) -> None:
        self._handler = callback_handler = compile_callbacks()  # only a compiled run pays for dynamo's import
        callback_handler.register_start_callback(self._begin)
        callback_handler.register_end_callback(self._end)

    def _begin(self, _args) -> None:
        self._began = time.time()

    def _end(self, _args) -> None:
        self.seconds += time.time() - self._began

    def stop(self) -> float:
        """Unhooked (a notebook's next run starts from zero); the seconds so far."""
        if self._handler is not None:
            self._handler.remove_start_callback(self._begin)
            self._handler.remove_end_callback(self._end)
            self._handler = None
        return self.seconds
