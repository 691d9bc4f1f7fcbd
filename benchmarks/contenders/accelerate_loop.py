"""The same loop written for HF Accelerate.

torchrun --standalone --nproc-per-node=N benchmarks/contenders/accelerate_loop.py gpt 3 out.json [--device cuda]
"""

import gc
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import call, contender_args, loss_fn, make_optimizer, report, setup, sync, unpack  # noqa: E402


def main() -> None:
    args = contender_args()
    accelerator = Accelerator(
        cpu=args.device == "cpu",
        mixed_precision="bf16" if args.amp == "bf16" else "no",
        dynamo_backend="inductor" if args.compile else "no",
    )
    cfg, ctx, bundle, model = setup(args)
    optimizer = make_optimizer(model, cfg)
    loader = DataLoader(
        bundle.train,
        batch_size=cfg.training.batch_size,
        shuffle=True,
        collate_fn=bundle.collate_fn,
        generator=torch.Generator().manual_seed(cfg.experiment.seed),
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    times = []
    for epoch in range(args.epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        start = time.perf_counter()
        for batch in loader:
            inputs, target = unpack(batch)
            with accelerator.autocast():
                loss = loss_fn(call(model, inputs), target)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
        sync(accelerator.device)
        times.append(time.perf_counter() - start)
    report(args.out, times, {"distributed_type": str(accelerator.distributed_type)})
    # As ddplab does: with gloo, a DDP model alive when the process group goes aborts about one
    # 2-process run in four. The accelerator keeps its own references to what it prepared, and
    # end_training() may destroy the group itself, so both go first.
    accelerator.free_memory()
    del model, optimizer, loader
    gc.collect()
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
