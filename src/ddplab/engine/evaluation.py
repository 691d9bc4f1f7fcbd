"""One global evaluation: every rank scores its shard, the evaluator's sums are all-reduced once."""

from __future__ import annotations

import torch

from ddplab.data.stream import size
from ddplab.engine.sharding import is_sharded
from ddplab.tasks import call_model, to_device


@torch.no_grad()
def evaluate(model: torch.nn.Module, task, batches, ctx, autocast) -> tuple[dict, object]:
    """(metrics, the evaluator) for the batches of a loader (`task.unpack` reads each), with the unwrapped model."""
    # DDP syncs buffers at the start of each training forward, so after the last step every
    # rank holds its own BatchNorm statistics: evaluate all shards with rank 0's, as DDP would.
    ctx.broadcast_buffers(model)
    was_training = model.training
    model.eval()
    evaluator = task.evaluator(ctx.device)
    # Sharded (fsdp/hsdp), each forward pass gathers parameters from every rank: a rank whose shard
    # has a batch fewer repeats its last one, unscored, so that all make as many passes.
    lockstep = is_sharded(model)
    if lockstep and (count := size(batches)) is not None:
        extra = int(ctx.all_reduce(torch.tensor([float(count)], device=ctx.device), "max").item()) - count
        lockstep = False
    else:
        extra = 0
    inputs = None
    for batch in _agreed(batches, ctx) if lockstep else batches:
        if batch is None:  # this stream's shard is out, another rank's is not
            with autocast():
                call_model(model, inputs)
            continue
        inputs, target, _ = task.unpack(to_device(batch, ctx.device))
        with autocast():
            output = call_model(model, inputs)
        evaluator.update(output, target)
    for _ in range(extra):
        with autocast():
            call_model(model, inputs)
    model.train(was_training)
    return evaluator.compute(ctx), evaluator


def _agreed(batches, ctx):
    """A stream's batches, then None while any other rank still has one (one all-reduce per batch: the
    length of a stream's shard is known only at its end)."""
    batches = iter(batches)
    while True:
        batch = next(batches, None)
        if ctx.all_reduce(torch.tensor([float(batch is not None)], device=ctx.device), "max").item() == 0:
            return
        yield batch
