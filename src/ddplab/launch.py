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
