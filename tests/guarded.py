"""Run `ddplab ARGS` (or a script's main) in a child held to a memory limit and a cap on the processes it starts,
for the tests of resource bounds: a regression there must fail its test, not take the shared machine down.

    python tests/guarded.py MAX_PROCESSES [ddplab arguments...]
    python tests/guarded.py MAX_PROCESSES --stamps FILE [key=value ...]   # ddplab.train, step ends in FILE

RLIMIT_AS bounds the child's own memory; loader workers and agents are processes of their own, whose memory
RLIMIT_AS does not add up (and RLIMIT_NPROC does not hold root), so every process start past MAX_PROCESSES
(multiprocessing's and subprocess's) ends the child with exit 99 instead."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

MEMORY_LIMIT = 8 * 2**30  # address space of the child itself: a torch process maps about 3 GiB
TOO_MANY = 99  # the exit of a child that tried to start more processes than it was allowed


def command(max_processes: int, *args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), str(max_processes), *args]


def run(max_processes: int, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`ddplab ARGS` guarded, from `cwd`; its own session, killed whole at the timeout."""
    from conftest import _env

    proc = subprocess.Popen(
        command(max_processes, *args),
        cwd=cwd,
        env={**_env(), "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_limit,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def guard(max_processes: int) -> None:
    import multiprocessing.process

    started = [0]

    def counted(start):
        def wrapper(*args, **kwargs):
            started[0] += 1
            if started[0] > max_processes:
                print(f"guarded: process {started[0]} refused (at most {max_processes})", file=sys.stderr, flush=True)
                os._exit(TOO_MANY)
            return start(*args, **kwargs)

        return wrapper

    multiprocessing.process.BaseProcess.start = counted(multiprocessing.process.BaseProcess.start)
    subprocess.Popen.__init__ = counted(subprocess.Popen.__init__)


def train_stamped(stamps: str, overrides: list[str]) -> int:
    """ddplab.train(overrides) with a callback that appends the wall-clock time at the end of every step to
    `stamps`: when the last step ended, for a test of how long the run takes to exit after it."""
    import ddplab

    class Stamp(ddplab.Callback):
        def on_step_end(self, view) -> None:
            with open(stamps, "a") as f:
                f.write(f"{time.time()}\n")

    summary = ddplab.train(None, overrides, callbacks=[Stamp()])
    return 0 if summary["status"] == "complete" else 1


if __name__ == "__main__":
    guard(int(sys.argv[1]))
    if sys.argv[2] == "--stamps":
        sys.exit(train_stamped(sys.argv[3], sys.argv[4:]))
    from ddplab.cli import main

    sys.exit(main(sys.argv[2:]))
