"""Resume overhead vs position in the epoch: ddplab's sampler seek against replaying batches.

Resuming at 10 % and at 90 % of a large synthetic epoch, the time until the first new batch
is ready. ddplab slices the epoch's global order (ResumableDistributedSampler.set_epoch(
epoch, start=consumed)); the baseline replays the consumed batches and throws them away,
as HF Trainer and Composer do. Ratio 90 % / 10 % printed for both, side by side.

    python benchmarks/resume_overhead.py [--samples 400000] [--batch-size 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from itertools import islice

import torch
from torch.utils.data import DataLoader, Dataset

from ddplab.data.sampler import ResumableDistributedSampler


class Synthetic(Dataset):
    """A token window per index, made on the fly (no memory for a large epoch)."""

    def __init__(self, n: int, length: int = 64) -> None:
        self.n, self.length = n, length

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.arange(i, i + self.length) % 256
        return x, x


def first_batch_seconds(data, world: int, batch: int, consumed: int, replay: bool) -> float:
    sampler = ResumableDistributedSampler(data, world, 0, seed=0)
    t0 = time.perf_counter()
    if replay:
        sampler.set_epoch(3)
        batches = iter(DataLoader(data, batch_size=batch, sampler=sampler))
        for _ in islice(batches, consumed // (batch * world)):  # seen before the stop: replayed, dropped
            pass
    else:
        sampler.set_epoch(3, start=consumed)
        batches = iter(DataLoader(data, batch_size=batch, sampler=sampler))
    next(batches)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=400_000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--world", type=int, default=2, help="ranks the epoch is split over (rank 0 is timed)")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    data = Synthetic(a.samples)
    step = a.batch_size * a.world
    results = {}
    print(f"epoch of {a.samples:,} samples, {a.world} ranks x batch {a.batch_size}; median of {a.repeat}")
    print(f"{'position':>9} {'ddplab seek (ms)':>17} {'replay (ms)':>12}")
    for position in (0.1, 0.9):
        consumed = int(a.samples * position) // step * step
        seek = statistics.median(
            first_batch_seconds(data, a.world, a.batch_size, consumed, False) for _ in range(a.repeat)
        )
        replay = statistics.median(
            first_batch_seconds(data, a.world, a.batch_size, consumed, True) for _ in range(a.repeat)
        )
        results[position] = (seek, replay)
        print(f"{position:>9.0%} {seek * 1e3:>17.1f} {replay * 1e3:>12.1f}")
    print(
        f"ratio 90%/10%: ddplab {results[0.9][0] / results[0.1][0]:.2f}   "
        f"replay {results[0.9][1] / results[0.1][1]:.2f}"
    )
    print(f"at 90%: replay takes {results[0.9][1] / results[0.9][0]:.0f}x ddplab's seek")


if __name__ == "__main__":
    main()
