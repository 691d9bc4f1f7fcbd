"""One global evaluation: every rank scores its shard, the evaluator's sums are all-reduced once."""

from __future__ import annotations

import torch

from ddplab.engine.sharding import is_sharded
from ddplab.tasks import call_model, to_device


@torch.no_grad()
def evaluate(model: torch.nn.Module, task, batches, ctx, autocast) -> tuple[dict, object]:
    """(metrics, the evaluator) for `batches` of (inputs, target), with the unwrapped model."""
    # DDP syncs buffers at the start of each training forward, so after the last step every
    # rank holds its own BatchNorm statistics: evaluate all shards with rank 0's, as DDP would.
    ctx.broadcast_buffers(model)
    was_training = model.training
    model.eval()
    evaluator = task.evaluator(ctx.device)
    # Sharded (fsdp/hsdp), each forward pass gathers parameters from every rank: a rank whose shard
    # has a batch fewer repeats its last one, unscored, so that all make as many passes.
    extra = int(ctx.all_reduce(torch.tensor([float(len(batches))], device=ctx.device), "max").item()) - len(batches) if is_sharded(model) else 0
    for inputs, target in batches:
        inputs, target = to_device(inputs, ctx.device), to_device(target, ctx.device)
        with autocast():
            output = call_model(model, inputs)
        evaluator.update(output, target)
    for _ in range(extra):
        with autocast():
            call_model(model, inputs)
    model.train(was_training)
    return evaluator.compute(ctx), evaluator
