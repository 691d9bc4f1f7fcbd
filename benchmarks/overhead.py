"""ddplab against a hand-written DDP loop, HF Accelerate and Lightning Fabric.

Same model, data, seed, per-process batch and process count for every contender; runs
alternate between contenders so drifting machine load hits all of them alike. For each
workload and process count it prints the median training time per epoch (the first epoch
of every run is a warm-up and is not counted; each run trains enough epochs that its timed
epochs hold at least --steps optimizer steps per process, default 600, so one run of the
digits CNN, at 3-7 ms a step, is timed over several seconds, not one 0.15 s epoch), the
spread of the runs, the per-pair ratios' range, and one line per pair:

    ratio ddplab/<contender> <workload> nproc=<N> <value>

plus ddplab's data-wait share: the time the slowest rank waited for its next batch, over
the epoch time.

    python benchmarks/overhead.py                      # all workloads, 1 and 2 processes, 5 runs each
    python benchmarks/overhead.py --contenders ddplab,handwritten --workloads cnn --steps 1000
    python benchmarks/overhead.py --workloads gpt --nproc 2 --runs 3
    python benchmarks/overhead.py --device cuda --nproc 1 --workloads gpt_medium --amp bf16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import WORKLOADS, machine  # noqa: E402

CONTENDERS = {
    "ddplab": "ddplab_run.py",
    "handwritten": "handwritten.py",
    "accelerate": "accelerate_loop.py",
    "fabric": "fabric_loop.py",
}


def run_once(contender: str, workload: str, nproc: int, epochs: int, options: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(HERE / "contenders" / CONTENDERS[contender]), workload, str(epochs), str(out), *options]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
        faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"{contender} {workload} nproc={nproc} failed:\n{proc.stderr[-3000:]}")
        # Minor page faults of the launcher and all its workers, start-up included.
        return {**json.loads(out.read_text()),
                "page_faults": resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - faults}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--nproc", default="1,2")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=600,
                   help="optimizer steps per process timed in each run (after a warm-up epoch); sets the epochs")
    p.add_argument("--epochs", type=int, default=None, help="epochs per run instead of --steps; the first is a warm-up")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--amp", choices=("none", "bf16"), default="none", help="autocast precision for every contender")
    p.add_argument("--compile", action="store_true", help="torch.compile the model in every contender")
    args = p.parse_args()
    contenders = args.contenders.split(",")
    options = ["--device", args.device, "--amp", args.amp] + (["--compile"] if args.compile else [])
    print(f"machine: {machine()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}")
    print(f"device {args.device}, amp {args.amp}, compile {args.compile}")
    print(f"runs: {args.runs} per contender, alternating; first epoch of each run not counted; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for workload in args.workloads.split(","):
        for nproc in (int(n) for n in args.nproc.split(",")):
            epochs = args.epochs
            if epochs is None:  # a one-epoch probe tells the steps an epoch has at this process count
                steps = run_once("handwritten", workload, nproc, 1, options)["steps_per_epoch"]
                epochs = 1 + math.ceil(args.steps / steps)
                print(f"{workload} nproc={nproc}: {steps} steps per epoch; {epochs} epochs per run, "
                      f"{(epochs - 1) * steps} timed steps per process", flush=True)
            times: dict[str, list[float]] = {c: [] for c in contenders}
            waits: list[float] = []
            rates: list[float] = []
            mfus: list[float] = []
            for i in range(args.runs):
                order = contenders[i % len(contenders):] + contenders[: i % len(contenders)]
                for contender in order:
                    result = run_once(contender, workload, nproc, epochs, options)
                    times[contender].append(statistics.mean(result["epoch_times"][1:]))
                    print(f"  run {i + 1} {contender} {workload} nproc={nproc}: {times[contender][-1]:.3f} s/epoch",
                          flush=True)
                    if contender == "ddplab":
                        waits += [w / t for w, t in zip(result["data_wait_s"][1:], result["epoch_times"][1:]) if w is not None]
                        rates += [r for r in result.get("tokens_per_s", [])[1:] if r]
                        mfus += [m for m in result.get("mfu", [])[1:] if m]
            medians = {c: statistics.median(v) for c, v in times.items()}
            print(f"\n{workload}, {nproc} process(es): median seconds per epoch")
            for c in contenders:
                spread = f"(min {min(times[c]):.3f}, max {max(times[c]):.3f}; " \
                         f"spread {100 * (max(times[c]) - min(times[c])) / medians[c]:.1f} % of the median)"
                print(f"  {c:12s} {medians[c]:.3f} {spread}")
            for c in contenders:
                if c != "ddplab" and "ddplab" in medians:
                    pairs = [a / b for a, b in zip(times["ddplab"], times[c])]  # runs next to each other
                    print(f"ratio ddplab/{c} {workload} nproc={nproc} {medians['ddplab'] / medians[c]:.3f}")
                    print(f"  run-by-run ratios {min(pairs):.3f}-{max(pairs):.3f}")
            if waits:
                print(f"data wait ddplab {workload} nproc={nproc} {100 * statistics.median(waits):.2f}% of epoch time")
            if rates:
                print(f"tokens/s ddplab {workload} nproc={nproc} {statistics.median(rates):,.0f}")
            if mfus:
                print(f"mfu ddplab {workload} nproc={nproc} {100 * statistics.median(mfus):.2f}%")
            print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
