"""SIGTERM / SIGUSR1 / SIGINT (SLURM pre-emption, `scancel`, torchrun shutting down, Ctrl-C) -> snapshot and exit.

The handler only raises a flag; the trainer reduces it across ranks after every step, so
all ranks stop after the same step, write one snapshot together and exit with
ExitCode.PREEMPTED. A second signal gets the previous behaviour (usually: die now), unless it
comes within ECHO_S of the first: the same stop reaching a worker again by another path (Ctrl-C
under plain torchrun comes from the terminal and from the agent; a signal sent to one worker of
ddplab's launcher comes back from the agent as SIGTERM) must not cut the snapshot short.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from pathlib import Path
from typing import TypeVar

from ddplab.handoff import Handoff

ECHO_S = 5.0


_Signals = TypeVar("_Signals", bound="StopSignals")


class StopSignals:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict = {}
        self._at = 0.0

    def install(self: _Signals) -> _Signals:
        # Signals can only be handled by the main thread (tests may call fit() from others).
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        if self.received is None:
            self.received, self._at = name, now
            _ask_launcher(name)
        elif now - self._at > ECHO_S:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _ask_launcher(name: str) -> None:
    """The signal may have reached this worker alone (`kill PID`): ddplab's launcher then stops the job
    as if it had received it, so that torchrun's agent ends the job instead of restarting the workers
    once they exit (--max-restarts). A stop the launcher began already is not begun twice."""
    if path := Handoff.read().stop_request:
        with contextlib.suppress(OSError):
            Path(path).write_text(name)
