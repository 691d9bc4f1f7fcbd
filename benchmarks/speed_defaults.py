"""Does each speed default of ddplab's loop earn its place? One on/off pair per default.

Runs under torchrun; every variant trains the same GPT steps in the same processes,
alternating variants round by round, and prints the median step time of each pair and
`ratio default/alternative <name> <value>` (below 1: the default is faster).

    torchrun --standalone --nproc-per-node=2 benchmarks/speed_defaults.py --rounds 5
    python benchmarks/speed_defaults.py            # one process

CUDA-only defaults (pinned memory with non-blocking copies, TF32 matmul) are
measured only where CUDA is present, and gradient buckets as views only with 2+ processes
(one process has no DDP); elsewhere they are reported as not measured.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab.models.gpt import GPT, GPTConfig


def make(device, bucket_view: bool, fused: bool):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=96, context=64, layers=2, heads=4, dim=128)).to(device)
    wrapped = DDP(model, gradient_as_bucket_view=bucket_view) if dist.is_initialized() else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    return wrapped, opt


def run(variant: dict, device, steps: int, batches) -> float:
    model, opt = make(device, variant["bucket_view"], variant["fused"])
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = variant["tf32"]
    losses = torch.zeros((), device=device)
    start = None
    for i in range(steps + 3):
        if i == 3:  # warm-up steps are not timed
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        x, images = batches[i % len(batches)]
        if variant["pinned"] and device.type == "cuda":  # what DataLoader(pin_memory=True) does to every batch
            x, images = x.pin_memory(), images.pin_memory() if images is not None else None
        x = x.to(device, non_blocking=variant["non_blocking"])
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        if images is not None:
            loss = loss + 0.0 * images.to(device, non_blocking=variant["non_blocking"]).mean()
        opt.zero_grad(set_to_none=variant["set_to_none"])
        loss.backward()
        opt.step()
        if variant["item_every_step"]:
            losses += loss.item()
        else:
            losses += loss.detach()
    losses.item()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / steps
    del model, opt
    return elapsed


DEFAULT = {
    "set_to_none": True,
    "bucket_view": True,
    "item_every_step": False,
    "non_blocking": True,
    "fused": True,
    "tf32": True,
    "pinned": True,
}
PAIRS = {  # name -> the alternative to ddplab's default; CUDA-only pairs last
    "zero_grad(set_to_none=True)": {"set_to_none": False},
    "gradient_as_bucket_view": {"bucket_view": False},
    "no .item() per step": {"item_every_step": True},
    "pinned memory + non_blocking copies": {"pinned": False, "non_blocking": False},
    "fused AdamW": {"fused": False},
    "TF32 matmul": {"tf32": False},
}
CUDA_ONLY = {"pinned memory + non_blocking copies", "TF32 matmul"}
COPY_PAIR = "pinned memory + non_blocking copies"
DDP_ONLY = {"gradient_as_bucket_view"}  # one process has no DDP, so nothing to compare


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    main_rank = not dist.is_initialized() or dist.get_rank() == 0
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 96, (args.batch, 65), generator=g) for _ in range(4)]
    # Copies matter for image batches, not token ids: the pinned-memory pair also moves a 224x224 RGB batch.
    with_images = [(t, torch.randn(args.batch, 3, 224, 224, generator=g)) for t in tokens] if cuda else []
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for name, change in PAIRS.items():
            if (name in CUDA_ONLY and not cuda) or (name in DDP_ONLY and not dist.is_initialized()):
                continue
            for label, variant in (("default", DEFAULT), ("alternative", {**DEFAULT, **change})):
                batches = with_images if name == COPY_PAIR else [(t, None) for t in tokens]
                times.setdefault(name, {}).setdefault(label, []).append(run(variant, device, args.steps, batches))
    if main_rank:
        world = dist.get_world_size() if dist.is_initialized() else 1
        print(
            f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'}, {world} process(es), "
            f"{args.rounds} rounds x {args.steps} steps, torch {torch.__version__}"
        )
        for name in PAIRS:
            if name not in times:
                print(f"{name}: not measured (needs {'CUDA' if name in CUDA_ONLY else '2+ processes'})")
                continue
            d, a = statistics.median(times[name]["default"]), statistics.median(times[name]["alternative"])
            print(f"{name}: default {1000 * d:.2f} ms/step, without {1000 * a:.2f} ms/step")
            print(f"ratio default/alternative {name.replace(' ', '_')} {d / a:.3f}")
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
