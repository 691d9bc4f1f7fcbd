"""ddplab with and without `training.keep_host_memory` (glibc keeps freed memory in the process).

The setting is process-wide and cannot be undone inside a process, so each variant is its
own ddplab run (the same as `overhead.py` runs), alternating. Prints the median seconds per
epoch (first epoch of every run not counted), the minor page faults of a whole run, and

    ratio default/alternative keep_host_memory <workload> nproc=<N> <value>

    OMP_NUM_THREADS=1 python benchmarks/host_memory.py --runs 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402
from overhead import run_once  # noqa: E402

VARIANTS = {"default": [], "alternative": ["--set", "training.keep_host_memory=false"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="gpt,transformer,cnn")
    p.add_argument("--nproc", default="1")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3, help="epochs per run; the first is a warm-up")
    args = p.parse_args()
    print(f"machine: {machine()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}")
    for workload in args.workloads.split(","):
        for nproc in (int(n) for n in args.nproc.split(",")):
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            faults: dict[str, list[int]] = {v: [] for v in VARIANTS}
            for i in range(args.runs):
                for variant in list(VARIANTS) if i % 2 == 0 else list(VARIANTS)[::-1]:
                    result = run_once("ddplab", workload, nproc, args.epochs, VARIANTS[variant])
                    times[variant].append(statistics.mean(result["epoch_times"][1:]))
                    faults[variant].append(result["page_faults"])
                    print(
                        f"  run {i + 1} {variant} {workload} nproc={nproc}: {times[variant][-1]:.3f} s/epoch, "
                        f"{result['page_faults']:,} page faults",
                        flush=True,
                    )
            d, a = (statistics.median(times[v]) for v in VARIANTS)
            fd, fa = (statistics.median(faults[v]) for v in VARIANTS)
            print(
                f"\n{workload}, {nproc} process(es): kept {d:.3f} s/epoch ({fd:,.0f} page faults per run), "
                f"glibc defaults {a:.3f} s/epoch ({fa:,.0f})"
            )
            print(f"ratio default/alternative keep_host_memory {workload} nproc={nproc} {d / a:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
