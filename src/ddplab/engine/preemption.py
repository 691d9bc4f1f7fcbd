"""SIGTERM / SIGUSR1 (SLURM pre-emption, `scancel`, torchrun shutting down) -> snapshot and exit.

The handler only raises a flag; the trainer reduces it across ranks after every step, so
all ranks stop after the same step, write one snapshot together and exit with
ExitCode.PREEMPTED. A second signal gets the previous behaviour (usually: die now).
"""

from __future__ import annotations

import signal
import threading


class StopSignals:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict = {}

    def install(self) -> "StopSignals":
        # Signals can only be handled by the main thread (tests may call fit() from others).
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
