"""A minimal hand-written DDP loop, the pattern of the PyTorch DDP tutorial.

    torchrun --standalone --nproc-per-node=N benchmarks/contenders/handwritten.py gpt 3 out.json
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import call, loss_fn, report, setup  # noqa: E402


def main(workload: str, epochs: int, out: str) -> None:
    distributed = int(__import__("os").environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    cfg, ctx, bundle, model = setup(workload, epochs)
    rank, world = ctx.rank, ctx.world_size
    ddp = DDP(model) if distributed else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.training.weight_decay)
    sampler = DistributedSampler(bundle.train, num_replicas=world, rank=rank, seed=cfg.experiment.seed)
    loader = DataLoader(bundle.train, batch_size=cfg.training.batch_size, sampler=sampler,
                        collate_fn=bundle.collate_fn)
    times = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        for inputs, target in loader:
            loss = loss_fn(call(ddp, inputs), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        times.append(time.perf_counter() - start)
    report(out, times)
    del ddp, optimizer
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
