"""A minimal hand-written DDP loop, the pattern of the PyTorch DDP tutorial.

    torchrun --standalone --nproc-per-node=N benchmarks/contenders/handwritten.py gpt 3 out.json [--device cuda]
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import (autocast, call, contender_args, loss_fn, make_optimizer, move, report, setup,  # noqa: E402
                    sync)


def main() -> None:
    args = contender_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    cfg, ctx, bundle, model = setup(args)
    device = ctx.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model.to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if distributed else model
    if args.compile:
        ddp = torch.compile(ddp)
    optimizer = make_optimizer(model, cfg)
    sampler = DistributedSampler(bundle.train, num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.experiment.seed)
    loader = DataLoader(bundle.train, batch_size=cfg.training.batch_size, sampler=sampler,
                        collate_fn=bundle.collate_fn)
    times, steps = [], 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        for inputs, target in loader:
            if steps == args.max_steps:
                break
            steps += 1
            inputs, target = move(inputs, device), move(target, device)
            with autocast(args, device):
                loss = loss_fn(call(ddp, inputs), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        sync(device)
        times.append(time.perf_counter() - start)
    report(args.out, times, {"steps_per_epoch": len(loader)})
    del ddp, optimizer
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
