"""The same loop written for HF Accelerate.

    torchrun --standalone --nproc-per-node=N benchmarks/contenders/accelerate_loop.py gpt 3 out.json
"""

import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import call, loss_fn, report, setup  # noqa: E402


def main(workload: str, epochs: int, out: str) -> None:
    accelerator = Accelerator(cpu=True)
    cfg, ctx, bundle, model = setup(workload, epochs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.training.lr, betas=(0.9, 0.95),
                                  weight_decay=cfg.training.weight_decay)
    loader = DataLoader(bundle.train, batch_size=cfg.training.batch_size, shuffle=True,
                        collate_fn=bundle.collate_fn, generator=torch.Generator().manual_seed(cfg.experiment.seed))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    times = []
    for epoch in range(epochs):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        start = time.perf_counter()
        for inputs, target in loader:
            loss = loss_fn(call(model, inputs), target)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
        times.append(time.perf_counter() - start)
    report(out, times, {"distributed_type": str(accelerator.distributed_type)})
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
