"""SIGTERM / SIGUSR1 / SIGINT (SLURM pre-emption, `scancel`, torchrun shutting down, Ctrl-C) -> snapshot and exit.

The handler raises a flag that the ranks reduce at the log interval, so all stop after the same step and write one
snapshot: SIGTERM and SIGUSR1 are a pre-emption (`preempted`, exit 75: a requeue script reruns the command), SIGINT
and a callback's KeyboardInterrupt a Ctrl-C (`interrupted`, exit 130: nothing requeues it); where both came, the
Ctrl-C wins. A second signal gets the previous behaviour (usually: die now) unless it comes within ECHO_S of the
first: the same stop reaching a worker again by another path (plain torchrun's Ctrl-C comes from the terminal and
from the agent) must not cut the snapshot short. A signal that reached one worker alone stops the whole job; one
that torchrun's agent sends the survivors of a dead worker is never agreed (the dead rank fails the collective), so
the job is restarted, not ended.
"""

from __future__ import annotations

import signal
import threading
import time

from ddplab.runtime.process_state import STOP_SIGNALS

ECHO_S = 5.0


# What a stop is recorded as, by its code in the flag the ranks reduce with "max" (0: no stop).
STOPS = ("preempted", "interrupted")


class StopSignals:
    SIGNALS = STOP_SIGNALS

    def __init__(self) -> None:
        self.received: str | None = None
        self.code = 0  # 1 + STOPS.index(the stop's status), 0 before any
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
            self.code = 1 + STOPS.index("interrupted" if signum == signal.SIGINT else "preempted")
        elif now - self._at > ECHO_S:
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)

    def interrupt(self, why: str) -> None:
        """A stop as a Ctrl-C's, for a KeyboardInterrupt a callback raised (a Ctrl-C that reached Python as
        one): `why` names it in the stop's line."""
        self.received = self.received or why
        self.code = 1 + STOPS.index("interrupted")

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
