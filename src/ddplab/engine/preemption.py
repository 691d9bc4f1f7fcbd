"""SIGTERM / SIGUSR1 / SIGINT (SLURM pre-emption, `scancel`, torchrun shutting down, Ctrl-C) -> snapshot and exit.

The handler only raises a flag; the trainer reduces it across ranks after every step, so
all ranks stop after the same step, write one snapshot together and exit with
ExitCode.PREEMPTED. A second signal gets the previous behaviour (usually: die now), unless it
comes within ECHO_S of the first: the same stop reaching a worker again by another path (Ctrl-C
under plain torchrun comes from the terminal and from the agent; a signal sent to one worker of
ddplab's launcher comes back from the agent as SIGTERM) must not cut the snapshot short.

A signal that reached one worker alone (`kill PID`) stops the whole job all the same: the ranks agree
on it, snapshot, and report it (engine/reports.py), and ddplab's launcher stops torchrun's agents then,
before they could restart the workers (--max-restarts). The signal itself tells the launcher nothing:
torchrun's agent, restarting the workers after one died, sends the survivors the same SIGTERM, and
their stop is never agreed (the dead rank fails the collective), so the job is restarted, not ended.
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

    def install(self) -> None:
        # Signals can only be handled by the main thread (tests may call fit() from others).
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name, now = signal.Signals(signum).name, time.monotonic()
        if self.received is None:
            self.received, self._at = name, now
        elif now - self._at > ECHO_S:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)

    def interrupt(self, why: str) -> None:
        """A stop as a signal's, for a KeyboardInterrupt a callback raised (a Ctrl-C that reached Python as
        one): `why` names it in the stop's line."""
        self.received = self.received or why

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
