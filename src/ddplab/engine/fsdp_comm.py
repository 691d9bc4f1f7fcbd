"""FSDP2's collectives, timed: what CommMonitor is to DDP's gradient all-reduce, for fsdp and hsdp.

FSDP2 lets a sharded module take its own all-gather and reduce-scatter (set_custom_all_gather,
set_custom_reduce_scatter). ddplab hands each module a thin wrapper around the one it already has,
which stamps the moment a collective is called and the moment it is done. Under hsdp the gradients
are then all-reduced across nodes, from the reduce-scatter's end to FSDP's all-reduce hook. The
communication time is the union of these intervals, as for DDP: wall time during which at least one
collective was in flight, whether or not compute hid it. Evaluation's gathers are left out, as the
epoch's training clock leaves evaluation out.

On CPU (gloo) each call returns once the collective is done, so the host's clock times it. On CUDA
the wrapper runs in FSDP's communication stream and the stamps are events there (engine/clock.py's
Stamps), so an interval is the collective's own time on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from ddplab.engine.clock import InFlight, covered_s

if TYPE_CHECKING:  # FSDP's comm interfaces, from a private module: named for the checker only
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter


class ShardedCommMonitor(InFlight):
    """This rank's all-gathers, reduce-scatters and (hsdp) cross-node all-reduces in training."""

    layout: list = []  # no DDP buckets: metrics.json's comm section computes them, comm.units has FSDP's
    collectives = "all_gather, reduce_scatter"  # what it times, in metrics.json's comm section

    def __init__(self, device: torch.device, beat=None) -> None:
        super().__init__(device, beat)
        self._open: list[list] = []  # [begin, end or None] in the order begun, not yet counted
        self._reach = None  # the stamp where the intervals counted so far end

    def _settle(self) -> None:
        """Count the leading intervals that are done (on CUDA: whose events have completed), their union with
        what was counted before: an interval that began before the last counted end adds only what lies past it."""
        with self._lock:
            n = 0
            while n < len(self._open) and self._open[n][1] is not None and self.clock.ready(*self._open[n]):
                n += 1
            if not n:
                return
            done, self._open = self._open[:n], self._open[n:]
            offsets = self.clock.seconds(
                done[0][0] if self._reach is None else self._reach, *(t for pair in done for t in pair)
            )
            floor = 0.0 if self._reach is not None else float("-inf")
            pairs = [(max(b, floor), max(e, floor)) for b, e in zip(offsets[::2], offsets[1::2], strict=True)]
            self._comm_s += covered_s(pairs)
            last = max(range(n), key=lambda i: pairs[i][1])
            if pairs[last][1] > floor:
                self._reach = done[last][1]

    def begin(self, what: str, at=None) -> list:
        interval = [at if at is not None else self.clock.now(), None]
        with self._lock:
            if self.beat is None or self.beat.phase not in ("evaluation", "snapshot", "end"):
                self._open.append(interval)
                self.buckets += 1
            if self.beat is not None:
                self.beat.collective, self.beat.waiting = f"FSDP {what}", True
        if len(self._open) > 64:  # unread for a while: keep the events few
            self._settle()
        return interval

    def end(self, interval: list) -> None:
        stamp = self.clock.now()
        with self._lock:
            interval[1] = self.last_done = stamp
            self.done_count += 1
            if self.beat is not None:
                self.beat.waiting = False


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
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            return None
        if not groups:  # no parameters of its own, so no collectives
            continue
        group = groups[0]  # its own collectives, which a shard function may have set: wrapped, not replaced
        # A _Timed has the interface of the comm it wraps (allocate, __call__) without subclassing it.
        module.set_custom_all_gather(cast("AllGather", _Timed(group._all_gather_comm, monitor, "all_gather")))
        reduce = _Timed(group._reduce_scatter_comm, monitor, "reduce_scatter")
        module.set_custom_reduce_scatter(cast("ReduceScatter", reduce))
        if group._is_hsdp and group._all_reduce_hook is None:

            def all_reduce_hook(_: torch.Tensor, r: _Timed = reduce) -> None:
                monitor.end(monitor.begin("all_reduce", r.last_end))

            module.set_all_reduce_hook(all_reduce_hook)
            monitor.collectives = "all_gather, reduce_scatter, all_reduce across nodes"
    return monitor
