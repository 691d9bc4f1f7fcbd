"""One worker SIGKILLed at step 100 of 300: fault-tolerant replica groups against a restart.

    python benchmarks/replicas.py [--steps 300] [--kill-at 100] [--every 40]

replicas: `--replica-groups 2 --max-restarts 1`, distributed.fault_tolerance=replicas (2 groups x 1
process, torchft on gloo); group 1's worker is killed, its agent starts it again. Printed: the healthy
group's step time with both groups and while alone (medians of the gaps between its steps), the longest
gap (the stall), how long the restarted worker took to be back in the quorum, the healthy group's
committed steps lost, and the wall time to step 300.

none: `--nproc-per-node 2 --max-restarts 1`, one DDP job of 2 processes, snapshots every --every steps;
rank 1 is killed, torchrun restarts both, and the job resumes from its newest snapshot. Printed: the
steps lost (trained again) and the wall time to step 300.

Both train the same small GPT (2 x batch 16 per step) on CPU; the load average is printed with them.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = [
    "model.layers=2",
    "model.dim=128",
    "model.heads=4",
    "model.context=64",
    "training.batch_size=32",
    "training.epochs=100",
    "training.warmup_steps=0",
    "logging.trackers=[]",
    "logging.progress=false",
    "logging.log_every=10",
    "generate.max_new_tokens=0",
    "checkpoint.save_best=false",
    "distributed.timeout=60",
]


def _worker(marker: bytes) -> int | None:
    """The pid of the training process (not a torchrun agent) whose command line holds `marker`."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            marker in cmd
            and b"train" in cmd
            and not any(b"ddplab.commands.launch" in c or b"torch.distributed" in c for c in cmd)
        ):
            return int(proc.name)
    return None


def _rows(run: Path) -> list[dict]:
    try:
        with (run / "replicas.csv").open() as f:
            return [r for r in csv.DictReader(f) if r.get("time")]
    except OSError:
        return []


def _step(run: Path, rank: str = "0") -> tuple[int, int | None]:
    """(step, pid) of `rank` from the run's heartbeat."""
    try:
        beat = json.loads((run / "heartbeat.json").read_text())["ranks"][rank]
        return beat["step"], beat["pid"]
    except (OSError, ValueError, KeyError):
        return 0, None


@contextlib.contextmanager
def _job(args: list[str], cwd: Path):
    """`ddplab train ARGS` in its own session, killed whole if the measurement fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddplab", "train", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def replicas(cwd: Path, steps: int, kill_at: int) -> dict:
    began = time.time()
    args = [
        "--replica-groups",
        "2",
        "--max-restarts",
        "1",
        "distributed.fault_tolerance=replicas",
        f"training.max_steps={steps}",
        "experiment.name=ft",
        *MODEL,
    ]
    healthy, killed = cwd / "experiments" / "ft-group0", cwd / "experiments" / "ft-group1"
    with _job(args, cwd) as proc:
        while len(_rows(killed)) < kill_at:
            assert proc.poll() is None, "the job ended before the kill"
            time.sleep(0.02)
        old = _worker(b"distributed.replica_group=1")
        os.kill(old, signal.SIGKILL)
        kill_time = time.time()
        restarted = None
        while proc.poll() is None:
            if restarted is None and _worker(b"distributed.replica_group=1") not in (None, old):
                restarted = time.time()
            time.sleep(0.02)
    rows = _rows(healthy)
    times = [float(r["time"]) for r in rows]
    gap = {i: times[i] - times[i - 1] for i in range(1, len(rows))}  # the time row i's step took
    killed = next(i for i, r in enumerate(rows) if float(r["time"]) > kill_time)
    alone = [i for i in range(killed, len(rows)) if rows[i]["replicas"] == "1" and rows[i]["committed"] == "1"]
    back = next(i for i in range(alone[0], len(rows)) if rows[i]["replicas"] == "2")
    normal = statistics.median(gap[i] for i in range(10, killed))
    during = [
        i for i in alone[1:] if restarted and times[i - 1] >= restarted
    ]  # the restart shares this machine's cores
    before = [i for i in alone[1:] if i not in during]
    return {
        "step_s_both": normal,
        "step_s_alone": statistics.median(gap[i] for i in alone[1:]),
        "step_s_alone_before_restart": statistics.median(gap[i] for i in before) if before else None,
        "step_s_alone_during_restart": statistics.median(gap[i] for i in during) if during else None,
        "alone_steps": len(alone),
        "slow_steps_alone": sum(gap[i] > 1.2 * normal for i in alone[1:]),
        "longest_stall_s": max(gap[i] for i in range(killed, back + 11)),  # the failure, alone, the rejoin
        "rejoin_step_s": gap[back],
        "restart_to_quorum_s": times[back] - restarted if restarted else None,
        "kill_to_quorum_s": times[back] - kill_time,
        "steps_dropped": sum(r["committed"] == "0" for r in rows),
        "wall_to_last_step_s": times[-1] - began,
        "exit": proc.returncode,
    }


def restart(cwd: Path, steps: int, kill_at: int, every: int) -> dict:
    began = time.time()
    args = [
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        f"training.max_steps={steps}",
        f"checkpoint.every={every}",
        "experiment.name=restart",
        *MODEL,
    ]
    run = cwd / "experiments" / "restart"
    with _job(args, cwd) as proc:
        while (at := _step(run, "1"))[0] < kill_at:
            assert proc.poll() is None, "the job ended before the kill"
            time.sleep(0.01)
        os.kill(at[1], signal.SIGKILL)
        last = None
        while proc.poll() is None:
            if last is None and _step(run)[0] >= steps:
                last = time.time()
            time.sleep(0.02)
    resumed = re.search(r"resumed from .* step (\d+),", (run / "train.log").read_text())
    return {
        "killed_at_step": at[0],
        "resumed_at_step": int(resumed.group(1)) if resumed else None,
        "steps_lost": at[0] - int(resumed.group(1)) if resumed else None,
        "wall_to_last_step_s": (last or time.time()) - began,
        "exit": proc.returncode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-at", type=int, default=100)
    parser.add_argument("--every", type=int, default=40, help="snapshot interval of the restarted job")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddplab-bench-replicas-") as folder:
        a = replicas(Path(folder), ns.steps, ns.kill_at)
        print(json.dumps({"replicas": a}), flush=True)
        b = restart(Path(folder), ns.steps, ns.kill_at, ns.every)
    load = os.getloadavg()
    print(
        f"kill at step {ns.kill_at} of {ns.steps}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
        f"on {os.cpu_count()} cores"
    )
    print(f"{'':38}{'replicas (torchft)':>20}{'none + restart':>18}")
    na = float("nan")
    lines = [
        ("healthy step, both groups (s)", f"{a['step_s_both']:.3f}", ""),
        ("healthy step, alone (s)", f"{a['step_s_alone']:.3f}", ""),
        ("  alone, before the restart began", f"{a['step_s_alone_before_restart'] or na:.3f}", ""),
        ("  alone, while it starts (same cores)", f"{a['step_s_alone_during_restart'] or na:.3f}", ""),
        ("  alone steps / those > 1.2x normal", f"{a['alone_steps']} / {a['slow_steps_alone']}", ""),
        ("longest stall, kill to rejoin (s)", f"{a['longest_stall_s']:.2f}", ""),
        ("  the rejoin step (s)", f"{a['rejoin_step_s']:.2f}", ""),
        ("restart to back in quorum (s)", f"{a['restart_to_quorum_s'] or na:.1f}", ""),
        ("kill to back in quorum (s)", f"{a['kill_to_quorum_s']:.1f}", ""),
        ("steps lost (trained again)", "0", f"{b['steps_lost']}"),
        ("  steps dropped (not committed)", f"{a['steps_dropped']}", ""),
        (f"wall time to step {ns.steps} (s)", f"{a['wall_to_last_step_s']:.1f}", f"{b['wall_to_last_step_s']:.1f}"),
    ]
    for name, left, right in lines:
        print(f"{name:38}{left:>20}{right:>18}")
    print(f"{'exit':38}{a['exit']:>20}{b['exit']:>18}")


if __name__ == "__main__":
    main()
