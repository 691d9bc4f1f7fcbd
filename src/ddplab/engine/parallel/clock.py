"""The trainer's one continuous clock, with evaluation and snapshots clocked apart from training; moments on the
device (Stamps) and the time a rank spent in collectives (InFlight)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Literal

import torch


class Clock:
    """Every second inside fit() goes to the run's elapsed time and the epoch's wall time (tick); evaluations and
    snapshots are also clocked apart (timed), and the epoch's training time is the rest (in the TrainState `state`)."""

    def __init__(self, state, ctx) -> None:
        self.state, self.ctx = state, ctx
        self.activity: Literal["train", "eval", "snapshot"] = "train"  # what the loop is doing now
        self._mark = time.perf_counter()

    def restart(self) -> None:
        """The run's time counts from now (fit's start): what came before it is the start-up's."""
        self._mark = time.perf_counter()

    def tick(self) -> None:
        now = time.perf_counter()
        self.state.elapsed += now - self._mark
        self.state.epoch_time += now - self._mark
        self._mark = now

    @contextlib.contextmanager
    def timed(self, activity: Literal["eval", "snapshot"]):
        """Adds the block's seconds to state.epoch_eval_time or epoch_snapshot_time. On CUDA the clock starts
        once the training work queued before is done, so each holds its own device time."""
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)  # once per evaluation or snapshot, never per step
        self.ctx.beat.mark("evaluation" if activity == "eval" else activity)  # the heartbeat's phase too
        self.activity, started = activity, time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            if activity == "eval":
                self.state.epoch_eval_time += seconds
            else:
                self.state.epoch_snapshot_time += seconds
            self.activity = "train"


class Stamps:
    """Moments on this rank's clock: on CPU the host's perf_counter; on CUDA events in the current stream (when the
    device got there, not when the host queued it), read once both have completed (query(), never a sync)."""

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


def covered_s(pairs) -> float:
    """Seconds covered by at least one of the (begin, end) intervals: the length of their union."""
    total, reach = 0.0, float("-inf")
    for begin, end in sorted(pairs):
        total += max(end - max(begin, reach), 0.0)
        reach = max(reach, end)
    return total


class InFlight:
    """Seconds during which a collective was in flight on this rank, read per epoch (DDP's CommMonitor and FSDP's
    ShardedCommMonitor alike): the union of the begin()-end() intervals, never their sum, since collectives overlap
    one another; those begun during evaluation, a snapshot or the end are left out, as the training clock does."""

    layout: list  # DDP's gradient buckets as the reducer handed them over (metrics.json's comm section)
    collectives: str  # what it times, in metrics.json's comm section
    label: str  # what the heartbeat calls its collectives: "<label> <what>"

    def __init__(self, device: torch.device, beat=None) -> None:
        self.clock, self.beat = Stamps(device), beat  # beat: the rank's heartbeat (distributed.Beat)
        self._lock = threading.Lock()  # collectives complete on the backend's threads
        self._comm_s = self.delay_s = 0.0
        self.buckets = 0  # collectives called, since the last take_epoch
        self.done_count = 0  # collectives completed
        self.last_done: Any = None  # the Stamps moment the latest of them completed at
        self._open: list[list] = []  # [begin, end or None] in the order begun, not yet counted
        self._reach = None  # the stamp where the intervals counted so far end
        self._in_flight = 0

    def _settle(self) -> None:
        """Count the leading intervals that are done (on CUDA: whose events have completed), their union with
        what was counted before: an interval that began before the last counted end adds only what lies past it."""
        with self._lock:
            n = 0
            while n < len(self._open) and self._open[n][1] is not None and self.clock.ready(*self._open[n]):
                n += 1
            if not n:
                return
            done, self._open = self._open[:n], self._open[n:]
            offsets = self.clock.seconds(
                done[0][0] if self._reach is None else self._reach, *(t for pair in done for t in pair)
            )
            floor = 0.0 if self._reach is not None else float("-inf")
            pairs = [(max(b, floor), max(e, floor)) for b, e in zip(offsets[::2], offsets[1::2], strict=True)]
            self._comm_s += covered_s(pairs)
            last = max(range(n), key=lambda i: pairs[i][1])
            if pairs[last][1] > floor:
                self._reach = done[last][1]

    def begin(self, what: str, at=None) -> list:
        """A collective called now (or at the Stamps moment `at`); its interval, for end()."""
        interval = [at if at is not None else self.clock.now(), None]
        with self._lock:
            if self.beat is None or self.beat.phase not in ("evaluation", "snapshot", "end"):
                self._open.append(interval)
                self.buckets += 1
            if self.beat is not None:
                self.beat.collective, self.beat.waiting = f"{self.label} {what}", True
            self._in_flight += 1
        if len(self._open) > 64:  # unread for a while (no straggler check each log): keep the events few
            self._settle()
        return interval

    def end(self, interval: list) -> None:
        stamp = self.clock.now()
        with self._lock:
            interval[1] = self.last_done = stamp
            self.done_count += 1
            self._in_flight -= 1
            if self.beat is not None and not self._in_flight:
                self.beat.waiting = False

    @property
    def comm_s(self) -> float:
        """This rank's seconds in collectives since the last take_epoch, over those settled so far."""
        self._settle()
        return self._comm_s

    def take_epoch(self) -> dict:
        """This rank's totals since the last call; the counters start again from zero."""
        comm_s = self.comm_s
        with self._lock:
            out = {"comm_time_s": comm_s, "simulated_delay_s": self.delay_s, "comm_buckets": self.buckets}
            self._comm_s = self.delay_s = 0.0
            self.buckets = 0
        return out
