"""One global evaluation: every rank scores its shard, the evaluator's sums are all-reduced once."""

from __future__ import annotations

import itertools

import torch

from ddplab.data.stream import size
from ddplab.engine.parallel.sharding import is_sharded
from ddplab.tasks import call_model, item_counter, to_device


@torch.no_grad()
def evaluate(model: torch.nn.Module, task, batches, ctx, autocast) -> tuple[dict, object]:
    """(metrics, the evaluator) for the batches of a loader (`task.unpack` reads each), with the unwrapped model."""
    # DDP syncs buffers at the start of each training forward, so after the last step every
    # rank holds its own BatchNorm statistics: evaluate all shards with rank 0's, as DDP would.
    ctx.broadcast_buffers(model)
    was_training = model.training
    model.eval()
    evaluator = task.evaluator(ctx.device)
    if hasattr(evaluator, "items"):  # a loss that is a mean over items: counted as the model counts them
        evaluator.items = item_counter(task, model)
    passes = _passes(batches, ctx) if is_sharded(model) else batches
    inputs = None
    for batch in passes:
        if batch is not None:
            inputs, target, _ = task.unpack(to_device(batch, ctx.device))
        with autocast():
            output = call_model(model, inputs)
        if batch is not None:
            evaluator.update(output, target)
    model.train(was_training)
    return evaluator.compute(ctx), evaluator


def _passes(batches, ctx):
    """Sharded (fsdp/hsdp), each forward pass gathers parameters from every rank: a rank whose shard has a batch
    fewer repeats its last one, unscored (None among its passes), so that all make as many passes. A stream's
    batches are agreed batch by batch (one all-reduce each: the length of a stream's shard is known only at its
    end)."""
    count = size(batches)
    if count is not None:
        most = int(ctx.all_reduce(torch.tensor([float(count)], device=ctx.device), "max").item())
        yield from itertools.chain(batches, [None] * (most - count))
        return
    batches = iter(batches)
    while True:
        batch = next(batches, None)
        if ctx.all_reduce(torch.tensor([float(batch is not None)], device=ctx.device), "max").item() == 0:
            return
        yield batch
