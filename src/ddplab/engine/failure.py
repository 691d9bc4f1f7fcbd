"""What a failure at run time is, in one line, and its record when it came before the run folder was set up.

Once ddplab owns a run folder, every failure ends the same way (exit 1): a `RunError` says its cause
as it is; bad input that only showed at run time (a `UserError` then), a full disk and a bug (named by
the file and line that raised it) become one. A failure in training is recorded by the heartbeat
(engine/heartbeat.py); one while the workload's data or model was built, by `record` here: the
traceback in logs/rank<N>.log, `status: failed` and the line in metrics.json.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from pathlib import Path

from ddplab.engine.files import open_append
from ddplab.engine.heartbeat import gist, place_of
from ddplab.engine.run_folder import RunFolder
from ddplab.errors import RunError, UserError, disk_full, no_space, write_failed


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


def record(run_dir: Path, rank: int, exc: BaseException, line: str) -> None:
    """The traceback of a failure before training began in logs/rank<N>.log; rank 0 also marks the run
    failed in metrics.json, with the line. Nothing more is tried on a full disk: the terminal has the line."""
    try:
        logs = Path(run_dir) / RunFolder.LOGS
        with open_append(run_dir, Path(RunFolder.LOGS, f"rank{rank}.log")) as f:
            f.write(
                f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank}, host {socket.gethostname()}, "
                f"pid {os.getpid()}: failed before training began\n"
            )
            f.write("".join(traceback.format_exception(exc)))
        if rank == 0:
            run = RunFolder(run_dir, is_main=True)
            try:
                run.log(f"failed: {line}", echo=False)
                run.update_json(
                    RunFolder.METRICS_JSON,
                    status="failed",
                    failure={"summary": f"job failed: {line}", "error": line, "logs": str(logs)},
                )
            finally:
                run.close()
    except (OSError, RunError):
        pass
