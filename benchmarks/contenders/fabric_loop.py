"""The same loop written for Lightning Fabric.

torchrun --standalone --nproc-per-node=N benchmarks/contenders/fabric_loop.py gpt 3 out.json [--device cuda]
"""

import gc
import os
import sys
import time
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import call, contender_args, loss_fn, make_optimizer, report, setup, sync, unpack  # noqa: E402


def main() -> None:
    args = contender_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    fabric = Fabric(
        accelerator=args.device,
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        precision="bf16-mixed" if args.amp == "bf16" else "32-true",
    )
    fabric.launch()
    cfg, ctx, bundle, model = setup(args)
    optimizer = make_optimizer(model, cfg)
    if args.compile:
        model = torch.compile(model)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(
        DataLoader(bundle.train, batch_size=cfg.training.batch_size, shuffle=True, collate_fn=bundle.collate_fn)
    )
    times = []
    for epoch in range(args.epochs):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        start = time.perf_counter()
        for batch in loader:
            inputs, target = unpack(batch)
            loss = loss_fn(call(model, inputs), target)
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            optimizer.step()
        sync(fabric.device)
        times.append(time.perf_counter() - start)
    report(args.out, times)
    del model, optimizer, loader  # before the process group goes (gloo aborts otherwise)
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
