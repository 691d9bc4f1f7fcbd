"""How a worker tells the ddplab launcher that started it how it ended: a file in the folder the launcher
names (runtime/handoff.py: report_dir), which commands/launch.py reads. A worker no ddplab launcher listens to says it
itself."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ddplab.engine.run_folder.files import write_atomic
from ddplab.runtime.handoff import Handoff

STOPPING = "stopping"  # in the report folder: the launcher has asked the agents to stop


def _report(name: str, text: str) -> bool:
    folder = Handoff.read().report_dir
    if not folder or not Path(folder).is_dir():
        return False
    write_atomic(folder, f"{name}-rank{int(os.environ.get('RANK', '0')):05d}", text)
    return True


def listened() -> bool:
    """A ddplab launcher started this worker and prints what it reports (the workers stay quiet)."""
    folder = Handoff.read().report_dir
    return folder is not None and Path(folder).is_dir()


def tell(kind: str, text: str, shown: str | None = None) -> None:
    """A worker's user error (kind "error") or a failed job's report ("failure", engine/diagnosis/heartbeat.py) for the
    launcher to print once, instead of every worker's lines and torchrun's tracebacks; printed here when no ddplab
    launcher listens (`shown`: as the terminal shows it, where that is not `text`)."""
    if not _report(kind, text):
        print(f"ddplab: {shown or text}", file=sys.stderr, flush=True)


def report_stopped(status: str) -> None:
    """A stop its snapshot was saved for (`status`: preempted or interrupted, engine/loop/preemption.py). Then wait
    (10 s at most) until the launcher has asked the agents to stop: an agent that saw this worker exit first
    would take it for a failure and restart the workers (--max-restarts)."""
    if _report(status, ""):
        deadline, stopping = time.monotonic() + 10, Path(Handoff.read().report_dir or ".") / STOPPING
        while not stopping.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
