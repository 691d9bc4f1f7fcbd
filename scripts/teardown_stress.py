"""Run N consecutive 2-process gloo trainings and count the ones that abort at exit.

With gloo, a DDP model or optimizer still alive when the process group is destroyed makes
about one 2-process run in four die with `terminate called without an active exception`
(SIGABRT). ddplab releases them first, and so do the benchmark contenders; this script shows
the count is 0.

    python scripts/teardown_stress.py --runs 30
    python scripts/teardown_stress.py --runs 30 --contender handwritten   # benchmarks/contenders/handwritten.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["model.layers=1", "model.dim=32", "model.heads=2", "model.context=32", "training.batch_size=8",
        "training.max_steps=5", "data.limit=256", "logging.trackers=[]", "logging.progress=false",
        "generate.max_new_tokens=0", "checkpoint.save_best=false"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--contender", help="run benchmarks/contenders/CONTENDER.py (2 steps of cnn) instead of ddplab")
    args = parser.parse_args()
    contenders = Path(__file__).resolve().parents[1] / "benchmarks" / "contenders"
    if args.contender and not (contenders / f"{args.contender}.py").is_file():
        parser.error(f"--contender: no {args.contender}.py in {contenders}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            start = time.time()
            job = [str(contenders / f"{args.contender}.py"), "cnn", "1", f"{tmp}/run{i}.json", "--max-steps", "2"] \
                if args.contender else \
                ["-m", "ddplab", "train", *TINY, f"experiment.output_dir={tmp}", f"experiment.name=run{i}"]
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", *job],
                env=env, capture_output=True, text=True)
            aborted = proc.returncode != 0 or "terminate called" in proc.stderr or "SIGABRT" in proc.stderr
            failures += aborted
            print(f"run {i + 1:2d}/{args.runs}: exit {proc.returncode}{'  ABORTED' if aborted else ''} "
                  f"({time.time() - start:.1f} s)", flush=True)
            if aborted:
                print(proc.stderr[-2000:], file=sys.stderr)
    print(f"{args.runs - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
