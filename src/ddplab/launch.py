"""Start N local worker processes through torch's own launcher (torch.distributed.run)."""

from __future__ import annotations

import os
import subprocess
import sys


def torchrun_command(nproc: int, args: list[str], *, max_restarts: int = 0, nnodes: int = 1,
                     node_rank: int | None = None, rdzv_endpoint: str | None = None, run_id: str | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if run_id:
            cmd.append(f"--rdzv-id={run_id}")
        if node_rank is not None:
            cmd.append(f"--node-rank={node_rank}")
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    return cmd + ["-m", "ddplab"] + args


def run_workers(nproc: int, args: list[str], **kwargs) -> int:
    """Run `ddplab <args>` in `nproc` processes; returns the launcher's exit code."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(torchrun_command(nproc, args, **kwargs), env=env)


def run_workers_here(nproc: int, args: list[str], **kwargs) -> int:
    """`run_workers` with torch's launcher in this process, not a child: `ddplab train` has
    already paid for an interpreter and the torch import (its config checks need torch), so a
    second launcher process would pay for both again, before any worker starts."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cmd = torchrun_command(nproc, args, **kwargs)
    try:
        torchrun(cmd[cmd.index("torch.distributed.run") + 1:])
    except ChildFailedError as exc:  # the workers printed their errors; this is torch's summary of them
        print(exc.format_msg(), file=sys.stderr, flush=True)
        return 1
    return 0
