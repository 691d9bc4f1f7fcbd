"""Pool the paired rounds of several `overhead.py` logs into one ratio.

Each `overhead.py` run prints its rounds (`round N <contender> <workload> nproc=<P>: <s> s/epoch`); a round's
ddplab run and its contender's run form a pair. This reads every pair of one workload and process count from
the logs given and prints the geometric mean of all of them with its 95 % interval, as overhead.py does for one run:

    python benchmarks/pool_pairs.py --workload cnn --nproc 2 run1.log run2.log run3.log
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from common import paired_ratio, resolved


def pairs(log: Path, workload: str, nproc: int, contender: str) -> tuple[list[float], list[float]]:
    runs: dict[str, dict[int, float]] = {"ddplab": {}, contender: {}}
    pattern = re.compile(rf"\s*round (\d+) (\w+) {re.escape(workload)} nproc={nproc}: ([\d.]+) s/epoch")
    for line in log.read_text().splitlines():
        if (m := pattern.match(line)) and m[2] in runs:
            runs[m[2]][int(m[1])] = float(m[3])
    rounds = sorted(runs["ddplab"].keys() & runs[contender].keys())
    return [runs["ddplab"][r] for r in rounds], [runs[contender][r] for r in rounds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--contender", default="handwritten")
    args = parser.parse_args()
    ours: list[float] = []
    theirs: list[float] = []
    for log in args.logs:
        a, b = pairs(log, args.workload, args.nproc, args.contender)
        print(f"{log}: {len(a)} pairs")
        ours += a
        theirs += b
    ratio, lo, hi = paired_ratio(ours, theirs)
    print(f"ratio ddplab/{args.contender} {args.workload} nproc={args.nproc} {ratio:.3f}")
    print(
        f"  95 % interval {lo:.3f}-{hi:.3f} from {len(ours)} pairs; resolved to 5 %: "
        f"{'yes' if resolved(ratio, lo, hi, 0.05) else 'no'}"
    )


if __name__ == "__main__":
    main()
