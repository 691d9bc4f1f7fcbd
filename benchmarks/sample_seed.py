"""What reading each training sample under its own seed (data.per_sample_seed) costs, against a training step
of the built-in CNN on digits (configs/vision/cnn_digits_cpu.yaml, one process, batch 32, augmentation on):
the step as the rank runs it on CPU (reading its batch, then forward, backward, AdamW) and its compute alone.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/sample_seed.py
"""

from __future__ import annotations

import time

import torch

from ddplab.data.sample_seed import PerSampleSeed
from ddplab.engine.setup import build_data, build_model
from ddplab.registry import load_config, workload


def per_item(dataset, keys, batch: int, rounds: int = 5) -> float:
    """Seconds an item, read a batch at a time as the DataLoader does (__getitems__ where there is one)."""
    fetch = getattr(dataset, "__getitems__", None) or (lambda ks: [dataset[k] for k in ks])
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for at in range(0, len(keys), batch):
            fetch(keys[at:at + batch])
        best = min(best, (time.perf_counter() - start) / len(keys))
    return best


def main() -> None:
    cfg = load_config("configs/vision/cnn_digits_cpu.yaml", ["data.augment=true"])
    work = workload(cfg, None, None)
    torch.manual_seed(0)
    data = build_data(cfg, None, work)
    model = build_model(cfg, None, work, data)
    batch, n = cfg.training.batch_size, 4096
    # The seeding alone, around items that cost nothing to read: reading digits' augmented items varies
    # by more than the seeding costs on a shared host.
    items = [(i, 0) for i in range(n)]
    cost = per_item(PerSampleSeed(items, 0), [(1, i) for i in range(n)], batch) - per_item(items, list(range(n)), batch)
    read = per_item(data.train, list(range(512)), batch)
    loader = torch.utils.data.DataLoader(data.train, batch_size=batch, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [next(iter(loader)) for _ in range(3)]
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 3 or steps < 20:
        x, y = batches[steps % 3]
        loss = data.task.loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    step = (time.perf_counter() - start) / steps
    print(f"per-sample seed: {cost * 1e6:.1f} us per item, {cost * batch * 1e3:.3f} ms per batch of {batch} "
          f"(reading an augmented item: {read * 1e6:.0f} us)")
    print(f"training step (forward, backward, AdamW; loading excluded): {step * 1e3:.2f} ms")
    whole = step + read * batch  # on CPU the rank reads its batch itself (data.num_workers=0)
    print(f"cost: {100 * cost * batch / whole:.2f} % of a step with its reading ({whole * 1e3:.2f} ms), "
          f"{100 * cost * batch / step:.2f} % of the compute alone")


if __name__ == "__main__":
    main()
