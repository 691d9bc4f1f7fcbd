"""What reading each training sample under its own seed (data.per_sample_seed) costs a training step of the
built-in CNN on digits (configs/vision/cnn_digits_cpu.yaml, one process, batch 32, augmentation on), as the
rank runs it on CPU: reading its batch through the sampler (data.num_workers=0), then forward, backward, AdamW.

Runs of STEPS steps with seeding on and off alternate; the ratio of each pair's step times gives the cost,
printed as the median and range over the pairs, with the load average. The steps are timed in this
process's CPU time (one thread): on a host with more runnable processes than cores, wall time mostly
measures waiting for a core. The range is still wider than the cost, so the seeding is also timed alone,
around items that cost nothing to read (median and range over rounds), and set against the median step:
torch's generator only (what torchvision's transforms draw from), and torch's, Python's and numpy's (a
transform that draws from all three). Last, each call the seeding is made of, timed alone.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/sample_seed.py [PAIRS]
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
import timeit

import numpy as np
import torch

from ddplab.data.sample_seed import GENERATORS, PerSampleSeed, sample_seed
from ddplab.data.sampler import ResumableDistributedSampler
from ddplab.engine.loop.setup import build_data, build_model
from ddplab.registry import load_config, workload

STEPS = 10


def per_item(dataset, keys, batch: int, rounds: int = 7) -> float:
    """CPU seconds an item, read a batch at a time as the DataLoader does (__getitems__ where there is one)."""
    fetch = getattr(dataset, "__getitems__", None) or (lambda ks: [dataset[k] for k in ks])
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for at in range(0, len(keys), batch):
            fetch(keys[at : at + batch])
        best = min(best, (time.process_time() - start) / len(keys))
    return best


def seeding_alone(batch: int, generators: list[str], rounds: int = 9, n: int = 4096) -> list[float]:
    """Seconds an item that seeding `generators` adds to reading it, in `rounds` rounds (each the best of 3 reads
    seeded less the best of 3 plain)."""
    items = [(i, 0) for i in range(n)]
    seeded = PerSampleSeed(items, 0)
    seeded.seeded = generators
    return [
        per_item(seeded, [(1, i) for i in range(n)], batch, 3) - per_item(items, list(range(n)), batch, 3)
        for _ in range(rounds)
    ]


def calls() -> dict[str, float]:
    """CPU seconds of each call the seeding is made of (timeit, the best of 5)."""
    g, nprng = torch.default_generator, np.random.get_state()
    pyrng, trng, kept = random.getstate(), g.get_state(), GENERATORS["numpy"][1]()
    timed = {
        "torch.manual_seed (every device)": lambda: torch.manual_seed(123456789),
        "torch.default_generator.manual_seed": lambda: g.manual_seed(123456789),
        "random.seed, int < 2**32": lambda: random.seed(123456789),
        "random.seed, int < 2**64": lambda: random.seed(0x123456789ABCDEF),
        "np.random.seed, int < 2**32": lambda: np.random.seed(123456789),
        "np.random.seed, two 32-bit words (> 2**32)": lambda: np.random.seed([123456789, 1]),
        "sample_seed (integer arithmetic)": lambda: sample_seed(7, 3, 12345),
        "torch get_state + set_state": lambda: g.set_state(g.get_state()),
        "random.getstate + setstate": lambda: random.setstate(random.getstate()),
        "np.random.get_state + set_state": lambda: np.random.set_state(np.random.get_state()),
        "numpy's state kept through its C struct, read + put back": lambda: GENERATORS["numpy"][2](
            GENERATORS["numpy"][1]()
        ),
    }
    out = {}
    for name, call in timed.items():
        number = 200 if "np.random.get_state" in name else 5000
        out[name] = min(timeit.repeat(call, number=number, repeat=5, timer=time.process_time)) / number
    g.set_state(trng), random.setstate(pyrng), np.random.set_state(nprng), GENERATORS["numpy"][2](kept)
    return out


def main(pairs: int) -> None:
    cfg = load_config("configs/vision/cnn_digits_cpu.yaml", ["data.augment=true"])
    work = workload(cfg, None, None)
    torch.manual_seed(0)
    data = build_data(cfg, None, work)
    model = build_model(cfg, None, work, data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = cfg.training.batch_size

    def loader(seeded: bool) -> torch.utils.data.DataLoader:
        """The training loader as TrainFeed makes it, on one process."""
        sampler = ResumableDistributedSampler(data.train, 1, 0, shuffle=True, seed=cfg.experiment.seed)
        sampler.keyed = seeded
        dataset = PerSampleSeed(data.train, cfg.experiment.seed) if seeded else data.train
        return torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True)

    loaders = {True: loader(True), False: loader(False)}
    batches = {True: iter(()), False: iter(())}
    epochs = {True: 0, False: 0}

    def run(seeded: bool) -> float:
        """CPU seconds a step over STEPS steps, reading each batch as training does."""
        start = time.process_time()
        for _ in range(STEPS):
            x = next(batches[seeded], None)
            if x is None:  # a new epoch: the sampler reshuffles
                epochs[seeded] += 1
                loaders[seeded].sampler.set_epoch(epochs[seeded])
                batches[seeded] = iter(loaders[seeded])
                x = next(batches[seeded])
            loss = data.task.loss(model(x[0]), x[1])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return (time.process_time() - start) / STEPS

    run(True), run(False)  # warm-up
    load_before = os.getloadavg()
    on, off = [], []
    for i in range(pairs):
        for seeded in (True, False) if i % 2 == 0 else (False, True):
            (on if seeded else off).append(run(seeded))
    load_after = os.getloadavg()
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    step = statistics.median(off)
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    print(
        f"step with its reading (CPU time), seeding off: median {step * 1e3:.2f} ms "
        f"({min(off) * 1e3:.2f}-{max(off) * 1e3:.2f}); on: median {statistics.median(on) * 1e3:.2f} ms "
        f"({min(on) * 1e3:.2f}-{max(on) * 1e3:.2f}); {pairs} alternating pairs of {STEPS} steps"
    )
    print(f"ratio on / off: median {statistics.median(ratios):.4f} (range {min(ratios):.4f}-{max(ratios):.4f})")
    print(f"generators seeded for this dataset: {loaders[True].dataset.seeded}")
    for generators in (["torch"], ["torch", "random", "numpy"]):
        costs = seeding_alone(batch, generators)
        cost = statistics.median(costs)
        print(
            f"seeding {' + '.join(generators)} alone: median {cost * 1e6:.2f} us an item "
            f"({min(costs) * 1e6:.2f}-{max(costs) * 1e6:.2f}, {len(costs)} rounds), {cost * batch * 1e3:.3f} ms a "
            f"batch of {batch}: {100 * cost * batch / step:.2f} % of the median step"
        )
    print("each call (CPU time, best of 5):")
    for name, seconds in calls().items():
        print(f"  {name:<58}{seconds * 1e6:8.2f} us")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
