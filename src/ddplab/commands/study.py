"""Run a study's points one after another, each as its own `ddplab train` job: locally (several nodes: one agent
each on loopback), or through `srun`. A complete point is skipped, so the same command resumes a study."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ddplab.commands.launch import log_tail, run, torchrun_command
from ddplab.engine.parallel.world import expand_nodelist
from ddplab.engine.run_folder.files import write_atomic
from ddplab.engine.run_folder.folder import RunFiles, RunFolder
from ddplab.errors import ExitCode, RunError, UserError, stopped
from ddplab.study.grid import Point, Setup

LOG_FILE = "launcher.log"  # everything the launcher and the workers printed


def local_commands(setup: Setup, args: list[str], run_id: str) -> list[list[str]]:
    """One torchrun agent per node; several nodes meet on loopback through c10d rendezvous,
    which assigns node ranks itself (a fixed --node-rank is ignored by c10d)."""
    if setup.nodes == 1:
        return [torchrun_command(setup.per_node, args)]
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    return [
        torchrun_command(setup.per_node, args, nnodes=setup.nodes, rdzv_endpoint=endpoint, run_id=run_id)
        for _ in range(setup.nodes)
    ]


def slurm_command(setup: Setup, args: list[str], run_id: str, index: int, env=None) -> list[str]:
    """`srun` starts one agent per node of the allocation; they meet at the first node."""
    env = os.environ if env is None else env
    host = expand_nodelist(env.get("SLURM_JOB_NODELIST", "localhost"))[0]
    job = int(env.get("SLURM_JOB_ID", "0"))
    port = 20000 + (job * 31 + index) % 30000  # distinct per point and per job sharing a node
    agent = torchrun_command(setup.per_node, args, nnodes=setup.nodes, rdzv_endpoint=f"{host}:{port}", run_id=run_id)
    return ["srun", f"--nodes={setup.nodes}", f"--ntasks={setup.nodes}", "--ntasks-per-node=1", *agent]


def run_study(study_dir: Path, config: str | None, points: list[Point]) -> None:
    """Run every point not yet complete, in grid order, in the study folder (which the caller has locked)."""
    if slurm := "SLURM_JOB_ID" in os.environ:
        have = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
        need = max(p.setup.nodes for p in points)
        if need > have:
            raise UserError(
                f"--nproc asks for {need} nodes but this SLURM allocation has {have}; "
                f"use sbatch --nodes={need} or fewer nodes per point"
            )
    console = Console(highlight=False)
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("study", total=len(points))
        for index, point in enumerate(points):
            folder = study_dir / point.name
            label = f"[{index + 1}/{len(points)}] {point.name} ({point.setup.processes} processes)"
            if RunFiles(folder).finished():
                console.print(f"{label}: complete, skipped")
                progress.advance(task)
                continue
            progress.update(task, description=label)
            folder.mkdir(parents=True, exist_ok=True)
            record = {
                "study": study_dir.name,
                "point": point.point,
                "run": point.name,
                "repeat": point.repeat,
                "nodes": point.setup.nodes,
                "per_node": point.setup.per_node,
                "processes": point.setup.processes,
                "setup": point.setup.label,
                "swept": point.swept,
            }
            write_atomic(folder, RunFolder.POINT, json.dumps(record, indent=2) + "\n")
            args = ["train", *([config] if config else []), *point.overrides]
            run_id = f"{study_dir.name}-{point.name}"
            commands = (
                [slurm_command(point.setup, args, run_id, index)]
                if slurm
                else local_commands(point.setup, args, run_id)
            )
            start = time.perf_counter()
            # The report folder lies in the point's folder, which every node of the job sees.
            ended = run(commands, log=folder / LOG_FILE, report_in=folder)
            if ended.stopped or ended.code in (ExitCode.PREEMPTED, ExitCode.INTERRUPTED):
                raise stopped(
                    ended.kind or "preempted",
                    f"study {{stop}} during point {point.name}; finished points are kept and "
                    f"the same command continues the study",
                )
            if ended.code != 0 or not RunFiles(folder).finished():
                if tail := log_tail(folder / LOG_FILE):
                    print(tail, file=sys.stderr)
                raise RunError(
                    f"study stopped: point {point.name} failed (exit {ended.code}); log {folder / LOG_FILE}; "
                    f"finished points are kept and the same command resumes the study"
                )
            rate = (RunFiles(folder).summary() or {}).get("aggregates", {}).get("mean_samples_per_s")
            console.print(
                f"{label}: done in {time.perf_counter() - start:.1f} s" + (f", {rate:,.0f} samples/s" if rate else "")
            )
            progress.advance(task)
