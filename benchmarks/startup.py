"""What a short run costs end to end: `ddplab train training.max_steps=1` against the same model,
data and one step in a hand-written DDP loop under plain torchrun.

Both are started as a user would start them, through a launcher: `python -m ddplab train
--nproc-per-node N` and `python -m torch.distributed.run --standalone --nproc-per-node N
benchmarks/contenders/handwritten.py digits 1 OUT --max-steps 1`. ddplab keeps its defaults
(validation, snapshot, test evaluation, TensorBoard), so this is the price of one real command.
Runs alternate, and the wall time of each whole command is taken here, with the CPU seconds of
its whole process tree (user + system, from getrusage). It prints the median and range per side,
the run-by-run ratios' range, their geometric mean with a 95 % interval
(benchmarks/common.py: paired_ratio), ddplab's per-phase breakdown (the median of
each phase in metrics.json, for each ddplab side), the load average, and

    ratio ddplab/torchrun-hand startup nproc=<N> <value>

    python benchmarks/startup.py                      # 1 and 2 processes, 5 runs each
    python benchmarks/startup.py --nproc 2 --runs 7
    python benchmarks/startup.py --nproc 2 --set logging.plots=false
    git archive <commit> src | tar -x -C /tmp/old && python benchmarks/startup.py --before /tmp/old/src
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import WORKLOADS, paired_ratio  # noqa: E402


def run_once(
    side: str, nproc: int, workload: str, folder: Path, before: str | None = None, extra: tuple[str, ...] = ()
) -> tuple[float, float, dict]:
    out = folder / "result.json"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    if side == "ddplab-before":  # the same command on another checkout's ddplab
        env["PYTHONPATH"] = os.pathsep.join([before, env.get("PYTHONPATH", "")])
    if side.startswith("ddplab"):
        cmd = [
            sys.executable,
            "-m",
            "ddplab",
            "train",
            "--nproc-per-node",
            str(nproc),
            *WORKLOADS[workload],
            "training.max_steps=1",
            "logging.progress=false",
            f"experiment.output_dir={folder}",
            "experiment.name=s",
            *extra,
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(HERE / "contenders" / "handwritten.py"),
            workload,
            "1",
            str(out),
            "--max-steps",
            "1",
        ]
    start, used = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder)
    wall, now = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime
    if proc.returncode != 0:
        raise RuntimeError(f"{side} nproc={nproc} failed:\n{proc.stderr[-3000:]}")
    phases = {}
    if side.startswith("ddplab"):
        phases = json.loads((folder / "s" / "metrics.json").read_text()).get("phases", {})
    return wall, cpu, phases


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", default="1,2")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--workload", default="digits", choices=("digits", "cnn", "gpt", "transformer"))
    p.add_argument(
        "--before",
        metavar="SRC",
        help="also time ddplab from this src folder (e.g. an older checkout's "
        "src/), as side 'ddplab-before', in the same alternation",
    )
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for the ddplab sides only, e.g. logging.plots=false (repeatable)",
    )
    args = p.parse_args()
    sides = ["ddplab", "torchrun-hand"] + (["ddplab-before"] if args.before else [])
    print(
        f"workload {args.workload}, 1 step; runs alternate; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}; "
        f"load average {load()}" + (f"; ddplab overrides {' '.join(args.extra)}" if args.extra else "")
    )
    for nproc in (int(n) for n in args.nproc.split(",")):
        walls: dict[str, list[float]] = {s: [] for s in sides}
        cpus: dict[str, list[float]] = {s: [] for s in sides}
        phases: dict[str, list[dict]] = {s: [] for s in sides}
        for i in range(args.runs):
            for side in sides if i % 2 == 0 else sides[::-1]:
                with tempfile.TemporaryDirectory() as tmp:
                    wall, cpu, ph = run_once(side, nproc, args.workload, Path(tmp), args.before, tuple(args.extra))
                walls[side].append(wall)
                cpus[side].append(cpu)
                if ph:
                    phases[side].append(ph)
                load1 = os.getloadavg()[0]
                print(f"  run {i + 1} {side} nproc={nproc}: {wall:.2f} s, cpu {cpu:.2f} s (load {load1:.2f})")
        print(f"\nnproc={nproc}: median wall seconds per command ({args.runs} runs each); load average {load()}")
        for side in sides:
            v, c = walls[side], cpus[side]
            print(
                f"  {side:14s} {statistics.median(v):.2f} (min {min(v):.2f}, max {max(v):.2f}); "
                f"cpu {statistics.median(c):.2f} (min {min(c):.2f}, max {max(c):.2f})"
            )
        pairs = [a / b for a, b in zip(walls["ddplab"], walls["torchrun-hand"], strict=True)]
        for side, runs in phases.items():
            if runs:
                keys = [k for k in runs[0] if all(k in ph for ph in runs)]
                print(
                    f"  {side} phases (rank 0, median s): "
                    + ", ".join(f"{k[:-2]} {statistics.median(ph[k] for ph in runs):.2f}" for k in keys)
                )
        print(f"  run-by-run ratios {min(pairs):.3f}-{max(pairs):.3f}")
        mean, lo, hi = paired_ratio(walls["ddplab"], walls["torchrun-hand"])
        print(f"  paired runs: geometric mean {mean:.3f}, 95 % interval {lo:.3f}-{hi:.3f}")
        ratio = statistics.median(walls["ddplab"]) / statistics.median(walls["torchrun-hand"])
        if args.before:
            old = statistics.median(walls["ddplab-before"]) / statistics.median(walls["torchrun-hand"])
            print(f"ratio ddplab-before/torchrun-hand startup nproc={nproc} {old:.3f}")
        print(f"ratio ddplab/torchrun-hand startup nproc={nproc} {ratio:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
