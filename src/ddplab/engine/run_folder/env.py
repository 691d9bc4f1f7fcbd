"""What a run folder's env.json records: enough to reproduce or explain a number."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata

import torch

import ddplab

RECORDED_ENV = "OMP_NUM_THREADS CUDA_VISIBLE_DEVICES SLURM_JOB_ID TORCHELASTIC_RUN_ID MASTER_ADDR MASTER_PORT".split()


def _version(dist_name: str) -> str | None:
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(dist_name)
    return None


def git_commit() -> str | None:
    """The commit of the ddplab checkout in use, or of the working directory."""
    for where in (os.path.dirname(os.path.abspath(__file__)), os.getcwd()):
        try:
            out = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0:
            status = ["git", "-C", where, "status", "--porcelain", "--untracked-files=no"]
            dirty = subprocess.run(status, capture_output=True, text=True, timeout=5).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    return None


def local_info(device: torch.device) -> dict:
    info = {"host": socket.gethostname(), "pid": os.getpid(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            device_memory_gb=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
        )
    else:
        info.update(
            device_name=platform.processor() or platform.machine(),
            cpu_count=os.cpu_count(),
            torch_threads=torch.get_num_threads(),
        )
    return info


def collect(ctx) -> dict:
    """Call on every rank (it gathers); use the result on rank 0, the only one that asks git:
    in a thread, so its two subprocesses overlap the gather instead of following it."""
    with ThreadPoolExecutor(max_workers=1) as pool:  # no thread starts until a task is submitted
        commit = pool.submit(git_commit) if ctx.is_main else None
        per_rank = ctx.gather_objects(local_info(ctx.device))
        git = commit.result() if commit is not None else None
    nccl = None
    with contextlib.suppress(Exception):  # a build without NCCL
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version()) if torch.cuda.is_available() else None
    return {
        "ddplab": ddplab.__version__,  # the code that ran, installed or not
        "git_commit": git,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torchvision": _version("torchvision"),
        "transformers": _version("transformers"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "nccl": nccl,
        "platform": platform.platform(),
        "launcher": ctx.launch.launcher,
        "launched_via": ctx.launch.via,  # what started the launcher (Kubeflow Trainer, SkyPilot), where it says
        "backend": ctx.backend,
        "world_size": ctx.world_size,
        "hosts": sorted({r["host"] for r in per_rank}),
        "ranks": per_rank,
        "command": sys.argv,
        "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
    }
