"""FSDP2's collectives, timed: what CommMonitor is to DDP's gradient all-reduce, for fsdp and hsdp.

Each sharded module's all-gather and reduce-scatter (set_custom_all_gather, set_custom_reduce_scatter) is wrapped
in one that stamps when it is called and when it is done; under hsdp, the cross-node all-reduce runs from the
reduce-scatter's end to FSDP's all-reduce hook. Communication time is the union of these intervals, as for DDP.
On CUDA the stamps are events in FSDP's communication stream (loop/clock.py's Stamps): the collective's own time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from ddplab.engine.parallel.clock import InFlight
from ddplab.engine.parallel.torch_internals import fsdp_comms

if TYPE_CHECKING:  # FSDP's comm interfaces, from a private module: named for the checker only
    from ddplab.engine.parallel.torch_internals import AllGather, ReduceScatter


class ShardedCommMonitor(InFlight):
    """This rank's all-gathers, reduce-scatters and (hsdp) cross-node all-reduces in training."""

    layout: list = []  # no DDP buckets: metrics.json's comm section computes them, comm.units has FSDP's
    collectives = "all_gather, reduce_scatter"  # what it times, in metrics.json's comm section
    label = "FSDP"


class _Timed:
    """A module's all-gather or reduce-scatter, called as before and timed (its buffers from the same place)."""

    def __init__(self, inner, monitor: ShardedCommMonitor, what: str) -> None:
        self.inner, self.monitor, self.what = inner, monitor, what
        self.last_end = None  # where this module's last reduce-scatter ended: where hsdp's all-reduce begins

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, *args, **kwargs):
        interval = self.monitor.begin(self.what)
        work = self.inner(output_tensor, input_tensor, group, *args, **kwargs)
        if work is None:  # a synchronous call: done on return (on CUDA, where the stream gets past it)
            self.monitor.end(interval)
            self.last_end = interval[1]
        else:
            work.get_future().then(lambda _: self.monitor.end(interval))
        return work


def install(model: torch.nn.Module, device: torch.device, beat=None) -> ShardedCommMonitor | None:
    """Time the collectives of every sharded module of `model`; None where FSDP offers no place to (a module
    with several parameter groups)."""
    from torch.distributed.fsdp import FSDPModule  # about a second to import: only sharded runs get here

    monitor = ShardedCommMonitor(device, beat)
    for module in (m for m in model.modules() if isinstance(m, FSDPModule)):
        groups = fsdp_comms(module)
        if len(groups) > 1:
            return None
        if not groups:  # no parameters of its own, so no collectives
            continue
        group = groups[0]  # its own collectives, which a shard function may have set: wrapped, not replaced
        # A _Timed has the interface of the comm it wraps (allocate, __call__) without subclassing it.
        module.set_custom_all_gather(cast("AllGather", _Timed(group.all_gather, monitor, "all_gather")))
        reduce = _Timed(group.reduce_scatter, monitor, "reduce_scatter")
        module.set_custom_reduce_scatter(cast("ReduceScatter", reduce))
        if group.hsdp and group.all_reduce_hook is None:

            def all_reduce_hook(_: torch.Tensor, r: _Timed = reduce) -> None:
                monitor.end(monitor.begin("all_reduce", r.last_end))

            module.set_all_reduce_hook(all_reduce_hook)
            monitor.collectives = "all_gather, reduce_scatter, all_reduce across nodes"
    return monitor
