"""A minimal hand-written DDP loop, the pattern of the PyTorch DDP tutorial.

    torchrun --standalone --nproc-per-node=N benchmarks/contenders/handwritten.py gpt 3 out.json [--device cuda]

`HandLoop` is the loop itself, one epoch per call; `interleaved.py` runs it inside ddplab's
own process too.
"""

import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import autocast, call, contender_args, loss_fn, make_optimizer, move, report, setup, sync, unpack  # noqa: E402


class HandLoop:
    """Model, DDP, AdamW and a DistributedSampler loader, built as the tutorial builds them; the
    process group, when there is one, must exist already."""

    def __init__(self, args) -> None:
        self.args = args
        cfg, ctx, bundle, model = setup(args)
        self.device = ctx.device
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        model.to(self.device)
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.ddp = (
            DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None) if distributed else model
        )
        if args.compile:
            self.ddp = torch.compile(self.ddp)
        self.optimizer = make_optimizer(model, cfg)
        self.sampler = DistributedSampler(
            bundle.train, num_replicas=ctx.world_size, rank=ctx.rank, seed=cfg.experiment.seed
        )
        self.loader = DataLoader(
            bundle.train, batch_size=cfg.training.batch_size, sampler=self.sampler, collate_fn=bundle.collate_fn
        )
        self.steps = 0

    def epoch(self, epoch: int) -> float:
        """Train one epoch; its wall time in seconds."""
        self.sampler.set_epoch(epoch)
        start = time.perf_counter()
        for batch in self.loader:
            inputs, target = unpack(batch)
            if self.steps == self.args.max_steps:
                break
            self.steps += 1
            inputs, target = move(inputs, self.device), move(target, self.device)
            with autocast(self.args, self.device):
                loss = loss_fn(call(self.ddp, inputs), target)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        sync(self.device)
        return time.perf_counter() - start

    def close(self) -> None:
        """Release DDP and what refers to it before the process group goes: with gloo, a DDP model
        alive at destroy_process_group() aborts about one 2-process run in four (SIGABRT)."""
        del self.ddp, self.optimizer, self.loader, self.sampler
        gc.collect()  # what sits in a reference cycle outlives `del` until the collector runs


def main() -> None:
    args = contender_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    loop = HandLoop(args)
    times = [loop.epoch(epoch) for epoch in range(args.epochs)]
    report(args.out, times, {"steps_per_epoch": len(loop.loader)})
    loop.close()
    del loop
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
