"""Heartbeats: which rank stalled, where, and the job's last word when it fails.

A daemon thread per rank publishes its `Beat` (distributed.py: phase, step, the collective entered) and where
the main thread stands to the c10d store every second: the store is reachable from every node and answers while
the ranks' collectives are stuck. Rank 0's thread reads every beat, warns once per stall, and keeps
`heartbeat.json` for `ddplab status`. A rank whose beat stops coming (SIGSTOP) is frozen: named as stalled.

A failing rank dumps its stack into logs/rank<N>.log and raises a failure count in the store; every other rank's
thread dumps its own stacks (faulthandler: also a main thread stuck in C) and ends its rank, so nothing waits for
torchrun's kill. Rank 0 writes the report failure.py composes (on NCCL with the flight recorder's unfinished
collectives); when rank 0 itself died, the first other rank to see it gone does (else the launcher, launch.py).
A beat that raises is reported once and the beats go on, without the store when the store was what failed.
A stop signal that comes while the main thread writes the report takes effect once the report is whole.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from ddplab.engine.diagnosis.failure import compose, exited, gist, log_traceback, place_text, where, where_raised
from ddplab.engine.diagnosis.flight_recorder import unfinished
from ddplab.engine.parallel.torch_internals import default_store, thread_frame
from ddplab.engine.run_folder.folder import amend
from ddplab.errors import LighthouseLost, RunError
from ddplab.runtime import process_state

_FAILED, _REPORTED, _REPORTER, _BEAT = "ddplab/failed", "ddplab/reported", "ddplab/reporter", "ddplab/beat/"
_DONE = "ddplab/done"  # how many of the other ranks no longer use the store, once the report is written
# Held while the beat is read or changed in memory (the main thread's frames, the ranks' last beats), never
# during a store call or a file write. A fork (DataLoader workers) waits for it, microseconds at most: a child
# forked mid-beat once hung a loader worker.
_BEATING = threading.Lock()
_END_SIGNAL = signal.SIGUSR2  # from the heartbeat thread to the main thread: another rank failed
# For the main thread to end once told to; past it, faulthandler ends the process. Rank 0 ends the trackers' runs
# as failed on its way out; another rank has nothing left to do once the report is written, and one stuck in C
# (a stopped rank continued in a gloo collective with a peer that is gone) waited distributed.timeout again there.
GRACE_S, OTHER_RANKS_GRACE_S = 30.0, 2.0


@functools.cache
def _guard_forks() -> None:
    """Once per process: a hook cannot be unregistered."""
    os.register_at_fork(before=_BEATING.acquire, after_in_parent=_BEATING.release, after_in_child=_BEATING.release)


class PeerFailed(BaseException):
    """Raised in the main thread when another rank failed; not an Exception, so that no `except Exception`
    on the way (a tracker's, a callback's) keeps the rank going."""


def _peer_failed(signum, frame) -> None:
    raise PeerFailed("another rank failed; rank 0 wrote the job's report")


@contextlib.contextmanager
def _stops_held() -> Iterator[None]:
    """The job's stop signals wait until the block is done, then take effect as they would have (by the handlers
    before it): torchrun's agent, which saw another rank die, stops the job while this rank writes the report, and a
    report cut short leaves the run `running` with no word of why. Only the main thread handles signals: elsewhere
    nothing is held. (pthread_sigmask would hold them off in this thread alone: another thread would take them.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    before = {sig: signal.signal(sig, lambda signum, frame: came.append(signum)) for sig in process_state.STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: one set outside Python
        for signum in dict.fromkeys(came):
            signal.raise_signal(signum)


_FROZEN_AFTER = 5.0  # s without a new beat (one a second): frozen (SIGSTOP, a debugger), its `still_s` stopped too


def frozen(beat: dict, now: float) -> dict:
    """A rank's beat as it stands now: a frozen rank still since its last beat, and waiting for nobody
    (it may have stopped inside a collective, but the others wait for it)."""
    late = now - beat.get("at", now)
    if late <= _FROZEN_AFTER:
        return beat
    return {**beat, "still_s": round(beat["still_s"] + late, 1), "waiting": False, "frozen": True}


class Heartbeat:
    """One per rank, for the whole run: start(), then fail(exc) on an error, stop() at the end."""

    def __init__(self, ctx, run, stall_warning: float, announce, interval: float = 1.0) -> None:
        self.ctx, self.beat, self.run = ctx, ctx.beat, run
        self.stall_warning, self.announce, self.interval = stall_warning, announce, interval
        self.store = default_store() if ctx.is_distributed else None
        self.log_path = Path(run.path) / run.LOGS / f"rank{ctx.rank}.log"
        self.seen: dict[int, dict] = {}  # rank 0: every rank's last beat
        self.mine: dict | None = None
        self._host = socket.gethostname()
        self._main = threading.get_ident()  # the thread that trains
        self._trouble: BaseException | None = None  # the first beat that raised (reported once)
        self._signals = False  # whether the main thread can be told to end (it installed the handler)
        self._deadline: TextIO | None = None  # the file faulthandler's last-resort dump goes to
        self._ticks, self._since, self._count = -1, time.monotonic(), 0
        self._warned: dict[int, int] = {}  # rank -> its beat count when a stall was last warned of
        self._started = time.time()  # flight recorder dumps older than this are an earlier attempt's
        self._ending = threading.Lock()
        self._ended = self._stopping = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ddplab-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        _guard_forks()
        if self.store is not None:  # undone when the run's process_state.changes() ends
            self._signals = process_state.signal_handler(_END_SIGNAL, _peer_failed)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping = True  # the main thread is ending the run: no signal for it from here on
        self._stop.set()
        self._thread.join(timeout=5)
        if self._deadline is not None:  # the main thread got here: it ends the normal way
            faulthandler.cancel_dump_traceback_later()
            self._deadline.close()
            self._deadline = None

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            shared = self.store is not None
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - reported once, then the beats go on
                # The store went with its host (rank 0, or torchrun's agent), and the job with it: every beat
                # stops before rank 0 leaves at the normal end. A rank stuck outside a collective would wait
                # for ever, so it ends as when a peer fails.
                lost = shared and self.store is None and not self._ended
                self._failed_beat(exc, "this rank ends: the job's store is gone" if lost else None)
                if lost:
                    self._end_rank()

    def _failed_beat(self, exc: Exception, then: str | None = None) -> None:
        # Once; and a store gone with a job that has ended is no news.
        if self._trouble is not None or (self._ended and self.store is None):
            return
        self._trouble = exc
        then = then or ("it goes on without the store" if self.store is None else "it goes on")
        log_traceback(self.run.path, self.ctx.rank, f"a heartbeat raised; {then}", exc)
        message = f"WARNING: rank {self.ctx.rank}'s heartbeat raised {gist(exc)}; {then} (traceback in {self.log_path})"
        if self.ctx.is_main:
            self.run.log(message)
        else:
            print(f"ddplab: {message}", file=sys.stderr, flush=True)

    def _describe(self) -> dict:
        """This rank's beat, read from memory: call it holding _BEATING."""
        now, b = time.monotonic(), self.beat
        if b.ticks != self._ticks:
            self._ticks, self._since = b.ticks, now
        frame = thread_frame(self._main)
        return {
            "rank": self.ctx.rank,
            "host": self._host,
            "pid": os.getpid(),
            "step": b.step,
            "at": time.time(),
            "phase": b.phase,
            "collective": b.collective,
            "waiting": b.waiting,
            "ticks": b.ticks,
            "still_s": round(now - self._since, 1),
            "where": where(frame) if frame is not None else None,
        }

    def _tick(self) -> None:
        with _BEATING:
            self.mine, self._count = self._describe(), self._count + 1
            mine, count = self.mine, self._count
            if self.store is None:
                self.seen[self.ctx.rank] = mine
        if self.store is not None:
            try:
                self.store.set(f"{_BEAT}{self.ctx.rank}", json.dumps(mine))
                heard = self._read_all() if self.ctx.is_main else {}
                failed = self.store.add(_FAILED, 0)
            except Exception:  # the store went with its host (rank 0, or the agent): _loop ends this rank
                self.store = None
                raise
            seen = self._seen(heard)
            if failed and not self._ended:
                self._end_rank()
                return
        if self.ctx.is_main and not self._ended:  # once the job has failed, its report says what each rank did
            seen = self._seen()
            self._warn(seen)
            if count % 5 == 1:
                self.run.write_json(
                    self.run.HEARTBEAT, {"time": time.time(), "ranks": seen, "progress": self.beat.progress}
                )

    def _seen(self, heard: dict[int, dict] | None = None) -> dict[int, dict]:
        """Every rank's last beat (rank 0), once the beats just `heard` are added."""
        with _BEATING:
            self.seen.update(heard or {})
            return dict(self.seen)

    def _read_all(self) -> dict[int, dict]:
        """Every rank's last beat in the store, each marked frozen or not."""
        store = self._store()
        now, keys = time.time(), {rank: f"{_BEAT}{rank}" for rank in range(self.ctx.world_size)}
        return {rank: frozen(json.loads(store.get(key)), now) for rank, key in keys.items() if store.check([key])}

    def _warn(self, seen: dict[int, dict]) -> None:
        for rank, b in seen.items():
            if not b["waiting"] and b["still_s"] >= self.stall_warning and self._warned.get(rank) != b["ticks"]:
                self._warned[rank] = b["ticks"]
                note = " (its heartbeat stopped too: the process is frozen)" if b.get("frozen") else ""
                self.run.log(
                    f"WARNING: rank {rank} (host {b['host']}) has not advanced for {b['still_s']:.0f} s{note} "
                    f"(distributed.stall_warning): phase {b['phase']}, step {b['step']}, at {place_text(b['where'])}"
                    + "".join(f"; rank {r} waits in {o['collective']}" for r, o in seen.items() if o["waiting"])
                )

    def _end_rank(self) -> None:
        """Another rank failed: report it (rank 0), dump this rank's stacks, and have the main thread end the rank.

        The main thread gets PeerFailed from a signal: a sleep or a wait in Python ends at once; a gloo
        collective returns when its peer's connection closes, or at distributed.timeout. A main thread that
        cannot run Python (stuck in C: a GPU sync, a collective) within its grace is ended by faulthandler, which
        dumps every stack again, as nothing else can end it."""
        with self._ending:
            if self._ended:
                return
            self._ended = True
        self._stop.set()
        try:
            if self.ctx.is_main:
                self._report(self._failures())
                self._others_done()
            else:
                self._wait_reported()
            log_traceback(
                self.run.path, self.ctx.rank, "another rank failed; this rank's stacks when the job ended", stacks=True
            )
        finally:
            if not self._stopping:
                self._deadline = open(self.log_path, "a")
                grace = GRACE_S if self.ctx.is_main else OTHER_RANKS_GRACE_S
                faulthandler.dump_traceback_later(grace, exit=True, file=self._deadline)
                if self._signals:
                    signal.pthread_kill(self._main, _END_SIGNAL)

    # ------------------------------------------------------------------ failure
    def fail(self, exc: BaseException, line: str | None = None, known: bool = False) -> dict | None:
        """This rank's training raised: dump, tell every rank, and (rank 0) write the report. `line`: the
        failure in one line, what the terminal shows when this rank's error is the job's; `known`: its
        cause is known (a non-finite loss, a full disk), so this rank is the culprit, not a peer that looks still."""
        with self._ending:
            if self._ended:
                return None
            self._ended = True
        told, failure = False, None
        with _stops_held():
            with contextlib.suppress(OSError):  # a full disk: the report still goes to the store and the terminal
                log_traceback(self.run.path, self.ctx.rank, f"rank {self.ctx.rank} failed", exc, stacks=True)
            # A rank that timed out in a collective is described as it stood while it waited there, any other by
            # where its error was raised (its main thread is here now, in the handler).
            raised = where_raised(exc)
            with _BEATING:
                waited = self.mine is not None and self.mine["waiting"]
                beat = self.mine if waited else {**self._describe(), "where": raised}
            outside = isinstance(exc, LighthouseLost)  # no rank's doing: the report blames none
            error = {
                "error": gist(exc),
                "where": raised,
                "line": line,
                "known": known,
                "outside": outside,
                "beat": beat,
            }
            if self.store is None:
                return self._report({self.ctx.rank: error}) if self.ctx.is_main else None
            with contextlib.suppress(Exception):  # the store is gone with rank 0: nothing more to tell
                self.store.set(f"{_FAILED}/{self.ctx.rank}", json.dumps(error))
                self.store.add(_FAILED, 1)
                told = True
                if self.ctx.is_main:
                    failure = self._report(self._failures())
        # The waits are no part of the report: a stop signal may end them.
        if failure is not None:
            self._others_done()
        elif told and not self.ctx.is_main:
            self._wait_reported()
        return failure

    def _store(self) -> dist.Store:
        if self.store is None:
            raise RuntimeError("the heartbeat's store is gone")
        return self.store

    def _failures(self) -> dict[int, dict]:
        store = self._store()
        keys = [f"{_FAILED}/{r}" for r in range(self.ctx.world_size)]
        return {r: json.loads(store.get(k)) for r, k in enumerate(keys) if store.check([k])}

    def _wait_reported(self, patience: float = 10) -> None:
        """Until rank 0 has written the report (`patience` seconds at most). When rank 0's process is gone,
        the first other rank to see it writes the report instead: the torchrun agent's store outlives rank 0."""
        deadline = time.monotonic() + patience
        with contextlib.suppress(Exception):  # the store went with rank 0 (it held it: no agent): nothing more to tell
            store = self._store()
            while not store.check([_REPORTED]) and time.monotonic() < deadline:
                # Rank 0's process has ended (on another host: no beat for 15 s, longer than a report takes).
                if store.check([f"{_BEAT}0"]) and exited(json.loads(store.get(f"{_BEAT}0")), patience=15):
                    if store.add(_REPORTER, 1) == 1:
                        with _stops_held():
                            self._report(self._failures())  # into the run folder that rank 0 kept
                    return
                time.sleep(0.2)
            # Done with the store: no beat of this rank uses it from here on, and rank 0 may let it go.
            self._stop.set()
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=2)
            store.add(_DONE, 1)

    def _others_done(self, patience: float = 5) -> None:
        """Rank 0 stays until every other rank is done with the store (`patience` seconds at most): under srun it
        holds the store, which none must meet closed; under torchrun the agent ends the others once rank 0 has
        left, before they end on their own. A rank frozen or gone never says: it is not waited for."""
        seen = self._seen()
        silent = sum(1 for r, b in seen.items() if r != self.ctx.rank and (b.get("frozen") or exited(b)))
        deadline = time.monotonic() + patience
        with contextlib.suppress(Exception):
            while self._store().add(_DONE, 0) < self.ctx.world_size - 1 - silent and time.monotonic() < deadline:
                time.sleep(0.1)

    def _report(self, errors: dict[int, dict]) -> dict:
        seen = self._seen()
        with contextlib.suppress(Exception):  # the latest beats, if the store still answers
            seen = self._seen(self._read_all())
        failure = compose(seen, errors, self.ctx.world_size, self.run.path, unfinished(self._started))
        with contextlib.suppress(OSError, RunError):  # a full disk: the terminal's copy is all there is
            amend(self.run.path, failure["report"], status="failed", failure=failure)
        # A rank's error in one line: of a known cause, as its RunError says it; else (a bug) the report's first
        # line, which names its phase, step, file and line. A rank that died or stalled: the full report, which
        # says what every other rank was doing.
        rank = failure["culprit"]["rank"]
        error = errors.get(rank) or next((e for e in errors.values() if e.get("outside")), {})
        self.announce(
            error["line"]
            if error.get("known") and error.get("line")
            else f"{failure['summary']} (traceback in {failure['logs']}/rank{rank}.log)"
            if error
            else failure["report"]
        )
        if self.store is not None:
            self.store.set(_REPORTED, "1")
        return failure
