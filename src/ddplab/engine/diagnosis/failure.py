"""A failure at run time: in one line, where it happened, the job's report, and its record.

Once ddplab owns a run folder, every failure ends with exit 1 and a `RunError` (as_run_error: bad input that only
showed at run time, a full disk, a bug named by the file and line that raised it). A failure in training is recorded
by the heartbeat, whose ranks' last beats and errors `compose` turns into the job's report; one while the workload's
data or model was built, by `record`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import socket
import sysconfig
import time
import traceback
from pathlib import Path

import torch

from ddplab.engine.run_folder.files import open_append
from ddplab.engine.run_folder.folder import RunFolder, amend
from ddplab.errors import RunError, UserError, disk_full, first_line, no_space, write_failed

_OURS = str(Path(__file__).resolve().parents[2])  # src/ddplab
_LIBRARIES = tuple(
    {str(Path(sysconfig.get_path(k)).resolve()) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    | {str(Path(torch.__file__).parent.resolve())}
)


def _library(filename: str) -> bool:
    return not filename.startswith(_OURS) and (filename.startswith(_LIBRARIES) or filename.startswith("<"))


def _place(f: traceback.FrameSummary) -> dict:
    return {"file": f.filename, "line": f.lineno, "function": f.name}


def where(frame) -> dict:
    """The innermost frame of the user's (or ddplab's) code: a stall inside torch is reported where
    the user's code called it."""
    stack = traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False)
    return _place(next((f for f in stack if not _library(f.filename)), stack[0]))


def where_raised(exc: BaseException) -> dict | None:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _library(f.filename)]
    return _place(frames[-1]) if frames else None


def place_of(exc: BaseException) -> str:
    """Where `exc` was raised, as FILE:LINE in FUNCTION: in a workload, the user's line."""
    return place_text(where_raised(exc))


def gist(exc: BaseException) -> str:
    """An error in one line: a gloo timeout comes wrapped in DDP's callback errors and a C++ source path."""
    if isinstance(exc, RunError):  # its message says what happened
        return first_line(exc, 400)
    text = re.sub(r"(Got the following error when running the callback: \w+: )+", "", str(exc).strip())
    if "Original Traceback" in text:  # raised in a DataLoader worker: its own message, and where in the dataset
        file, line, function = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', text)[-1]
        return f"{text.splitlines()[-1][:200]} (in a DataLoader worker, at {file}:{line} in {function})"
    line = re.sub(r"^\[[^\]]*:\d+\] ", "", (text.splitlines() or [""])[0])
    return f"{type(exc).__name__}: {line[:200]}"


_PF_EXITING = 0x4  # linux/sched.h: the process is exiting (its sockets close before it turns zombie)


def exited(beat: dict, patience: float = 3) -> bool:
    """On this host: the process has exited or is exiting (a zombie not yet reaped counts); elsewhere: no
    beat for `patience` seconds."""
    if beat["host"] != socket.gethostname():
        return time.time() - beat.get("at", time.time()) > patience
    try:
        fields = Path(f"/proc/{beat['pid']}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0] in ("Z", "X") or bool(int(fields[6]) & _PF_EXITING)
    except (OSError, IndexError, ValueError):
        return True


def place_text(place: dict | None) -> str:
    return f"{place['file']}:{place['line']} in {place['function']}" if place else "an unknown place"


def as_run_error(exc: BaseException, run_dir: Path) -> tuple[RunError, bool]:
    """`exc`, raised once the run folder `run_dir` was in use, as the RunError the terminal shows, and
    whether its cause is known (False: a bug, or a collective that failed because of a peer)."""
    if isinstance(exc, RunError):
        return exc, True
    if no_space(exc, run_dir):  # also behind a UserError or RuntimeError that names no cause
        full = disk_full(exc)
        return write_failed(full.filename if full is not None and full.filename else run_dir, exc), True
    if isinstance(exc, UserError):
        return RunError(str(exc)), True
    return RunError(f"{gist(exc)} at {place_of(exc)}; traceback in {Path(run_dir) / RunFolder.LOGS}"), False


def log_traceback(run_dir, rank: int, reason: str, exc: BaseException | None = None, stacks: bool = False) -> None:
    """In logs/rank<N>.log: why, `exc`'s traceback, and with `stacks` every thread's Python stack (faulthandler:
    also a thread stuck in C code)."""
    with open_append(run_dir, Path(RunFolder.LOGS, f"rank{rank}.log")) as f:
        f.write(
            f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank}, host {socket.gethostname()}, "
            f"pid {os.getpid()}: {reason}\n"
        )
        if exc is not None:
            f.write("".join(traceback.format_exception(exc)))
        if stacks:
            f.write("-- Python stacks of every thread (faulthandler):\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)


def record(run_dir: Path, rank: int, exc: BaseException, line: str) -> None:
    """The traceback of a failure before training began in logs/rank<N>.log; rank 0 also marks the run
    failed in metrics.json, with the line. Nothing more is tried on a full disk: the terminal has the line."""
    with contextlib.suppress(OSError, RunError):
        logs = Path(run_dir) / RunFolder.LOGS
        log_traceback(run_dir, rank, "failed before training began", exc)
        if rank == 0:
            failure = {"summary": f"job failed: {line}", "error": line, "logs": str(logs)}
            amend(run_dir, f"failed: {line}", status="failed", failure=failure)


def _reached(b: dict, beats: dict[int, dict]) -> int:
    """The step a rank whose beats stopped (frozen or gone) had reached. Its last beat can be a second older than
    its end, steps behind it; the peers waiting in a collective took every earlier collective with it, so it
    reached the step they wait in."""
    waited = [o["step"] for r, o in beats.items() if o["waiting"] and r != b["rank"]]
    return max(b["step"], min(waited)) if waited else b["step"]


def compose(beats: dict[int, dict], errors: dict[int, dict], world_size: int, run_dir, stuck=None) -> dict:
    """The failure section: the stalled (or failing) rank first, then what the others were waiting in."""
    beats = {**beats, **{r: e["beat"] for r, e in errors.items() if e.get("beat")}}
    # A rank whose process is gone (or whose beat stopped: another host) is what the others' errors are about,
    # else one that ended before its first beat; else a rank still for 2 s while not in a collective is the one
    # they waited for (a rank still moving is not).
    gone = [b for r, b in beats.items() if r not in errors and exited(b)] or [
        {"rank": r, "host": None, "phase": "start", "step": 0, "where": None, "waiting": False}
        for r in range(world_size)
        if r not in beats and r not in errors
    ]
    # A rank that failed of a known cause (a RunError: a non-finite loss, a full disk) is the culprit, even
    # when a peer that has not yet told its own error looks still.
    known = sorted(r for r, e in errors.items() if e.get("known"))
    still = sorted(
        (b for r, b in beats.items() if not b["waiting"] and r not in errors and b["still_s"] >= 2),
        key=lambda b: -b["still_s"],
    )
    stalled = [] if known else gone or still
    outside = next((e for e in errors.values() if e.get("outside")), None)  # a service the job needs failed
    if outside is not None:
        culprit, head = {"rank": None, "error": outside["error"]}, outside["error"]
    elif stalled:
        b = stalled[0]
        step = _reached(b, beats) if gone or b.get("frozen") else b["step"]
        seen = (
            f"in {b['phase']} at step {step}"
            if step == b["step"]
            else f"at step {step} (where its peers wait for it; its last heartbeat: {b['phase']} at step {b['step']})"
        )
        culprit = {"rank": b["rank"], "host": b["host"], "phase": b["phase"], "step": step, "where": b["where"]}
        head = (
            f"rank {b['rank']} died or froze before its first heartbeat"
            if gone and b["host"] is None
            else f"rank {b['rank']} died or froze (its heartbeat ended), last seen {seen} "
            f"(host {b['host']}): {place_text(b['where'])}"
            if gone
            else f"rank {b['rank']} stalled {seen} (host {b['host']}, no progress for "
            f"{b['still_s']:.0f} s{', its heartbeat stopped too: the process is frozen' if b.get('frozen') else ''}"
            f"): {place_text(b['where'])}"
        )
    else:
        rank = known[0] if known else min(errors) if errors else 0
        e, b = errors.get(rank, {}), beats.get(rank, {})
        culprit = {"rank": rank, **{k: b.get(k) for k in ("host", "phase", "step")}}
        culprit |= {"where": e.get("where") or b.get("where"), "error": e.get("error")}
        head = (
            f"rank {rank} failed in {b.get('phase')} at step {b.get('step')}: {e.get('error')} "
            f"at {place_text(culprit['where'])}"
        )
    waits = {r: b["collective"] for r, b in beats.items() if b["waiting"]}
    lines = [f"job failed: {head}"]
    for r in sorted(set(beats) | set(errors)):
        if r == culprit["rank"]:
            continue
        b, e = beats.get(r, {}), errors.get(r, {})
        said = f"waited in {waits[r]}" if r in waits else f"was in {b.get('phase')} at {place_text(b.get('where'))}"
        lines.append(f"  rank {r} {said} (step {b.get('step')})" + (f": {e['error']}" if e.get("error") else ""))
    for r, c in sorted((stuck or {}).items()):  # flight_recorder.unfinished
        lines.append(
            f"  rank {r} never completed {c['collective']} #{c['seq']} of process group {c['group']} "
            f"(sizes {c['sizes']}, {c['state']}; flight recorder)"
        )
    logs = Path(run_dir).resolve() / "logs"
    lines.append(f"  full logs: {logs.parent / 'train.log'} and {logs}/rank<N>.log (each rank's Python stacks)")
    return {
        "summary": lines[0],
        "culprit": culprit,
        "waiting": waits,
        "errors": {r: e.get("error") for r, e in errors.items()},
        "ranks_heard": sorted(beats),
        "world_size": world_size,
        "logs": str(logs),
        "report": "\n".join(lines),
        "unfinished_collectives": stuck or {},
    }
