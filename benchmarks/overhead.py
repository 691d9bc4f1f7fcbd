"""ddplab against a hand-written DDP loop, HF Accelerate and Lightning Fabric.

Same model, data, seed, per-process batch and process count for every contender; runs
alternate between contenders (one round runs each once, the order rotating), so drifting
machine load hits all of them alike. Each run trains a warm-up epoch, which is not counted,
then enough epochs that its timed epochs hold at least --steps optimizer steps per process;
the run's figure is the median of its timed epochs.

Single runs of one contender spread by 4-70 % on a shared 2-core machine, between runs more
than within one, so a ratio is resolved by the number of runs, not by their length. The
ratio against each contender is the geometric mean of the pair ratios (ddplab's run next to
the contender's, same round), with a 95 % Student-t interval; rounds go on past --runs, up to
--max-runs, until every interval lies within --resolve of its ratio. For each workload and
process count it prints the median seconds per epoch with each contender's spread, and:

    ratio ddplab/<contender> <workload> nproc=<N> <value>
      95 % interval <lo>-<hi> (+-<h> %) from <n> pairs; pairs <min>-<max>; resolved to 5 %: yes|no; <verdict>

plus ddplab's data-wait share: the time the slowest rank waited for its next batch, over
the epoch time, and for each ddplab run `reported/real`: the timed epochs' epoch_time_s over a continuous
clock over the same span (contenders/ddplab_run.py's RealClock: from the row before each epoch's to its own,
less evaluations and snapshots), with the range of the epochs' own ratios.

With --interleave, each run is one process (pair) that trains ddplab and the hand-written
loop epoch by epoch (contenders/interleaved.py): ddplab's epoch, then one of the hand loop's.
What slows a whole run down then slows both, and the ratio is resolved in far fewer runs;
what ddplab sets for the whole process (kept host memory) helps the hand loop too there, so
that mode measures the loops themselves, and the default mode the whole process. ddplab's
epoch goes first in each pair; --alternate puts the hand loop's first on odd epochs.

    python benchmarks/overhead.py                      # all workloads, 1 and 2 processes
    python benchmarks/overhead.py --contenders ddplab,handwritten --workloads cnn --runs 8
    python benchmarks/overhead.py --workloads gpt --nproc 2 --steps 200 --max-runs 10
    python benchmarks/overhead.py --interleave --workloads cnn,gpt
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
from common import WORKLOADS, machine, paired_ratio, resolved  # noqa: E402

CONTENDERS = {
    "ddplab": "ddplab_run.py",
    "handwritten": "handwritten.py",
    "accelerate": "accelerate_loop.py",
    "fabric": "fabric_loop.py",
    "interleaved": "interleaved.py",  # --interleave: ddplab and the hand-written loop in one process
}


def run_once(contender: str, workload: str, nproc: int, epochs: int, options: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(HERE / "contenders" / CONTENDERS[contender]),
            workload,
            str(epochs),
            str(out),
            *options,
        ]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
        faults = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"{contender} {workload} nproc={nproc} failed:\n{proc.stderr[-3000:]}")
        # Minor page faults of the launcher and all its workers, start-up included.
        return {
            **json.loads(out.read_text()),
            "page_faults": resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - faults,
        }


def verdict(lo: float, hi: float) -> str:
    if hi < 1:
        return "ddplab faster"
    if lo > 1:
        return "ddplab slower"
    return "level: the interval holds 1.0"


def ratios(times: dict[str, list[float]], within: float) -> dict[str, tuple[float, float, float, bool]]:
    """ddplab's paired ratio against each contender: (ratio, lo, hi, resolved within `within`)."""
    out = {}
    for c in times:
        if c != "ddplab":
            ratio, lo, hi = paired_ratio(times["ddplab"], times[c])
            out[c] = (ratio, lo, hi, resolved(ratio, lo, hi, within))
    return out


def report(times: dict[str, list[float]], workload: str, nproc: int, within: float) -> None:
    medians = {c: statistics.median(v) for c, v in times.items()}
    print(f"\n{workload}, {nproc} process(es): median seconds per epoch over {len(times['ddplab'])} runs")
    for c, v in times.items():
        print(
            f"  {c:12s} {medians[c]:.3f} (min {min(v):.3f}, max {max(v):.3f}; "
            f"spread {100 * (max(v) - min(v)) / medians[c]:.1f} % of the median)"
        )
    for c, (ratio, lo, hi, ok) in ratios(times, within).items():
        pairs = [a / b for a, b in zip(times["ddplab"], times[c], strict=True)]
        print(f"ratio ddplab/{c} {workload} nproc={nproc} {ratio:.3f}")
        print(
            f"  95 % interval {lo:.3f}-{hi:.3f} (+-{100 * max(hi / ratio - 1, 1 - lo / ratio):.1f} %) from "
            f"{len(pairs)} pairs; pairs {min(pairs):.3f}-{max(pairs):.3f}; resolved to {100 * within:g} %: "
            f"{'yes' if ok else 'no'}; {verdict(lo, hi)}",
            flush=True,
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="cnn,gpt,transformer", help=f"any of {','.join(WORKLOADS)}")
    p.add_argument("--nproc", default="1,2")
    p.add_argument("--runs", type=int, default=5, help="rounds at least (each contender once per round)")
    p.add_argument(
        "--max-runs",
        type=int,
        default=12,
        help="rounds at most: past --runs, rounds go on while a ratio is not resolved to --resolve",
    )
    p.add_argument(
        "--resolve",
        type=float,
        default=0.05,
        help="stop once every ratio's 95 %% interval lies within this fraction of it (default 0.05)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=300,
        help="optimizer steps per process timed in each run (after a warm-up epoch); sets the epochs",
    )
    p.add_argument("--epochs", type=int, default=None, help="epochs per run instead of --steps; the first is a warm-up")
    p.add_argument("--contenders", default="ddplab,handwritten,accelerate,fabric")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="ddplab and the hand-written loop epoch by epoch in the same processes",
    )
    p.add_argument(
        "--alternate",
        action="store_true",
        help="with --interleave: the hand-written epoch goes first on odd epochs (default: ddplab first)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--amp", choices=("none", "bf16"), default="none", help="autocast precision for every contender")
    p.add_argument("--compile", action="store_true", help="torch.compile the model in every contender")
    args = p.parse_args()
    contenders = ["ddplab", "handwritten"] if args.interleave else args.contenders.split(",")
    if contenders[0] != "ddplab" or len(contenders) < 2 or not set(contenders) <= set(CONTENDERS) - {"interleaved"}:
        p.error("--contenders: ddplab first, then one or more of handwritten, accelerate, fabric")
    options = (
        ["--device", args.device, "--amp", args.amp]
        + (["--compile"] if args.compile else [])
        + (["--alternate"] if args.alternate else [])
    )
    print(f"machine: {machine()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}")
    print(f"device {args.device}, amp {args.amp}, compile {args.compile}")
    print(
        f"rounds: {args.runs} to {max(args.runs, args.max_runs)}, until every ratio is resolved to "
        f"{100 * args.resolve:g} %; first epoch of each run not counted; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    for workload in args.workloads.split(","):
        for nproc in (int(n) for n in args.nproc.split(",")):
            epochs = args.epochs
            if epochs is None:  # a one-epoch probe tells the steps an epoch has at this process count
                steps = run_once("handwritten", workload, nproc, 1, options)["steps_per_epoch"]
                epochs = 1 + math.ceil(args.steps / steps)
                print(
                    f"{workload} nproc={nproc}: {steps} steps per epoch; {epochs} epochs per run, "
                    f"{(epochs - 1) * steps} timed steps per process",
                    flush=True,
                )
            times: dict[str, list[float]] = {c: [] for c in contenders}
            waits: list[float] = []
            rates: list[float] = []
            mfus: list[float] = []
            rounds = max(args.runs, args.max_runs)
            for i in range(rounds):
                order = contenders[i % len(contenders) :] + contenders[: i % len(contenders)]
                for contender in ["interleaved"] if args.interleave else order:
                    result = run_once(contender, workload, nproc, epochs, options)
                    timed = result["epoch_times"][1:]
                    runs = (
                        {contender: timed}
                        if not args.interleave
                        else {"ddplab": timed, "handwritten": result["hand_epoch_times"][1:]}
                    )
                    for name, epoch_times in runs.items():
                        times[name].append(statistics.median(epoch_times))
                        print(
                            f"  round {i + 1} {name} {workload} nproc={nproc}: {times[name][-1]:.3f} s/epoch "
                            f"(its epochs {min(epoch_times):.3f}-{max(epoch_times):.3f})",
                            flush=True,
                        )
                    if result.get("real_epoch_times"):  # metrics.csv's clock against a continuous one
                        # Over all timed epochs: each epoch's own ratio also holds the jitter of where its
                        # boundary hooks ran (collectives with a rank the scheduler held back), which cancels here.
                        real = result["real_epoch_times"][1:]
                        each = [t / r for t, r in zip(result["epoch_times"][1:], real, strict=True)]
                        print(
                            f"  reported/real ddplab {workload} nproc={nproc} round {i + 1}: "
                            f"{sum(result['epoch_times'][1:]) / sum(real):.3f} over {len(real)} epochs "
                            f"(each {min(each):.3f}-{max(each):.3f}); load average {os.getloadavg()[0]:.2f}",
                            flush=True,
                        )
                    if contender in ("ddplab", "interleaved"):
                        waits += [w / t for w, t in zip(result["data_wait_s"][1:], timed, strict=True) if w is not None]
                        rates += [r for r in result.get("tokens_per_s", [])[1:] if r]
                        mfus += [m for m in result.get("mfu", [])[1:] if m]
                if i + 1 < args.runs:
                    continue
                now = ratios(times, args.resolve)
                print(
                    f"  after round {i + 1}: "
                    + ", ".join(f"/{c} {r:.3f} ({lo:.3f}-{hi:.3f})" for c, (r, lo, hi, _) in now.items()),
                    flush=True,
                )
                if all(ok for *_, ok in now.values()) or i + 1 == rounds:
                    break
            report(times, workload, nproc, args.resolve)
            if not all(ok for *_, ok in now.values()):
                print(
                    f"  not resolved to {100 * args.resolve:g} % after {len(times['ddplab'])} rounds (raise --max-runs)"
                )
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
