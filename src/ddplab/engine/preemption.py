"""SIGTERM / SIGUSR1 / SIGINT (SLURM pre-emption, `scancel`, torchrun shutting down, Ctrl-C) -> snapshot and exit.

The handler only raises a flag; the trainer reduces it across ranks after every step, so
all ranks stop after the same step, write one snapshot together and exit with
ExitCode.PREEMPTED. A second signal gets the previous behaviour (usually: die now), unless it is
the same signal within ECHO_S: Ctrl-C under plain torchrun reaches a worker twice, from the
terminal and from the agent that forwards it, and the echo must not cut the snapshot short.
"""

from __future__ import annotations

import signal
import threading
import time

ECHO_S = 5.0


class StopSignals:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict = {}
        self._at = 0.0

    def install(self) -> "StopSignals":
        # Signals can only be handled by the main thread (tests may call fit() from others).
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        if self.received is None:
            self.received, self._at = name, now
        elif name != self.received or now - self._at > ECHO_S:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
