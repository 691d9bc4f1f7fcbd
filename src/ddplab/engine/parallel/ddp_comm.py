"""DDP communication hooks: every distributed run gets `timed( delayed( fp16 | bf16 | powersgd | all-reduce ) )`,
torch's compression inside a simulated wide-area link inside a timer that also records the reducer's bucket
layout; a StepTimer (hooks on the model) records forward and backward time per step: what `ddplab forecast` needs.
"""

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from ddplab.config import link_delay_s
from ddplab.engine.parallel.clock import InFlight, Stamps
from ddplab.engine.parallel.torch_internals import ddp_buckets, queue_after_backward

# Bytes each element of a bucket occupies on the wire, per compression hook. PowerSGD's
# low-rank payload depends on the tensor shapes; the uncompressed size is an upper bound.
_HOOKS: dict[str, tuple[Callable, int | None]] = {
    "none": (default_hooks.allreduce_hook, None),
    "fp16": (default_hooks.fp16_compress_hook, 2),
    "bf16": (default_hooks.bf16_compress_hook, 2),
    "powersgd": (powerSGD_hook.powerSGD_hook, None),
}
POWERSGD_RANK = 1  # matrix_approximation_rank of the powersgd hook


class CommMonitor(InFlight):
    """The hook state: gradient all-reduces in flight (InFlight), from DDP's hand-over (any simulated delay
    included) until the future completes."""

    collectives = "all_reduce"  # what it times, in metrics.json's comm section
    label = "DDP gradient"

    def __init__(self, dcfg, world_size: int, inner_state, device=torch.device("cpu"), beat=None) -> None:
        self.latency_ms = dcfg.simulated_latency_ms
        self.bandwidth_mbps = dcfg.simulated_bandwidth_mbps
        self.inner, self.wire_bytes = _HOOKS[dcfg.comm_hook]
        self.world_size, self.inner_state = world_size, inner_state
        super().__init__(device, beat)
        self.layout: list[dict] = []  # the buckets of the last recorded step, in the order DDP hands them over
        self._recording: list[dict] = []
        self._recorded_steps = 0

    def _record(self, bucket: dist.GradBucket) -> None:
        """Keep the bucket layout of the first few steps: DDP rebuilds its buckets in gradient
        order after the first step, so the last recorded step holds the layout it settles on."""
        if self._recorded_steps >= 3:
            return
        self._recording.append(_bucket_info(bucket.index(), bucket.parameters(), [bucket.buffer()]))
        if bucket.is_last():
            self.layout, self._recording = self._recording, []
            self._recorded_steps += 1

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        interval = self.begin("all_reduce")
        self._record(bucket)
        if self.latency_ms or self.bandwidth_mbps:
            buffer = bucket.buffer()
            nbytes = buffer.numel() * (self.wire_bytes or buffer.element_size())
            delay = link_delay_s(nbytes, self.world_size, self.latency_ms, self.bandwidth_mbps)
            self.delay_s += delay
            # Sleeping on the backward thread holds back this bucket and every later one, as
            # a link that delivers messages in order would; every rank sleeps the same time.
            time.sleep(delay)
        fut = self.inner(self.inner_state, bucket)

        def done(f: torch.futures.Future) -> torch.Tensor:
            self.end(interval)
            return f.value()

        return fut.then(done)


def _bucket_info(index: int, params, tensors: list[torch.Tensor]) -> dict:
    """A bucket of `params` whose gradients `tensors` hold (DDP's flat buffer, or the parameters themselves)."""
    # PowerSGD views each gradient as (rows, rest) and compresses it when it is a matrix.
    matrices = [[int(p.shape[0]), int(p.numel() // p.shape[0])] for p in params if p.dim() > 1]
    return {
        "index": index,
        "numel": sum(t.numel() for t in tensors),
        "bytes": sum(t.nbytes for t in tensors),
        "dtype": str(tensors[0].dtype).replace("torch.", ""),
        "params": len(params),
        "matrices": matrices,
    }


def install_comm_hook(model, dcfg, ctx) -> CommMonitor:
    """The timed (and optionally delayed) hook registered on a DDP model; its state."""
    state = None  # torch's hooks take None for the default group
    if dcfg.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=POWERSGD_RANK,
            start_powerSGD_iter=2,
            min_compression_rate=2,
            random_seed=0,
        )
    monitor = CommMonitor(dcfg, ctx.world_size, state, ctx.device, getattr(ctx, "beat", None))
    model.register_comm_hook(monitor, CommMonitor.__call__)
    return monitor


class StepTimer:
    """Forward and backward time of every training micro-step (grad enabled only), from hooks on the model.

    Backward runs from the output's gradient to the end of the backward pass (before DDP waits for its
    all-reduces); the gradient reduction still in flight after that is `exposed`, the communication the backward
    pass did not hide. The moments are loop/clock.py's Stamps (CUDA events on CUDA), read once completed."""

    def __init__(self, model: torch.nn.Module, monitor: InFlight | None = None) -> None:
        self.monitor = monitor
        self.clock = Stamps(next(model.parameters(), torch.empty(0)).device)
        self._step: list = []  # the open micro-step's stamps: forward start, end, backward start, end
        self._pending: list[list] = []  # closed micro-steps not yet read
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]
        self.take_epoch()

    def _close(self) -> None:
        step, self._step = self._step, []
        if len(step) >= 2:
            self._pending.append(step)
        if len(self._pending) > 32:  # on CUDA, the events of steps the device has finished
            self._settle()

    def _settle(self) -> None:
        while self._pending and self.clock.ready(*self._pending[0]):
            start, *ends = self._pending.pop(0)
            t = self.clock.seconds(start, *ends)
            self.forward_s += t[0]
            if len(t) >= 3:
                self.backward_s += t[2] - t[1]
                self.micro_steps += 1
            if len(t) == 4:
                self.exposed_s += max(t[3] - t[2], 0.0)

    def _pre(self, module, args) -> None:
        if torch.is_grad_enabled():
            self._close()
            self._step = [self.clock.now()]
            self._done_before = self.monitor.done_count if self.monitor is not None else 0

    def _post(self, module, args, output) -> None:
        if len(self._step) != 1 or not torch.is_grad_enabled():
            return
        self._step.append(self.clock.now())
        out = getattr(output, "logits", output)
        if isinstance(out, (tuple, list)):
            out = out[0]
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._begin_backward)

    def _begin_backward(self, grad) -> None:
        if len(self._step) == 2:
            self._step.append(self.clock.now())
            # The engine runs its end-of-backward callbacks in the order queued: this one before DDP's own,
            # which waits for the all-reduces; no hook sees the end of the whole pass otherwise.
            queue_after_backward(self._end_backward)

    def _end_backward(self) -> None:
        self._step.append(self.clock.now())
        if self.monitor is not None:  # queued behind DDP's and FSDP's own callbacks, which wait for the reduction
            queue_after_backward(self._reduced)

    def _reduced(self) -> None:
        monitor = self.monitor
        if monitor is not None and len(self._step) == 4 and monitor.done_count > self._done_before:
            self._step.append(monitor.last_done)  # this step's gradient reduction ended there

    def take_epoch(self) -> dict:
        self._close()
        self._settle()
        out = {
            "forward_time_s": getattr(self, "forward_s", 0.0),
            "backward_time_s": getattr(self, "backward_s", 0.0),
            "comm_exposed_s": getattr(self, "exposed_s", 0.0),
            "timed_micro_steps": getattr(self, "micro_steps", 0),
        }
        self.forward_s = self.backward_s = self.exposed_s = 0.0
        self.micro_steps = 0
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def attach_step_timer(model: torch.nn.Module, monitor: InFlight | None, cfg) -> StepTimer | None:
    """A StepTimer on the unwrapped model; none under torch.compile, whose graphs hooks would break."""
    return None if cfg.training.compile else StepTimer(model, monitor)


def epoch_comm_row(monitor: CommMonitor | None, ctx, epoch_time: float, timer: StepTimer | None = None) -> dict:
    """Communication vs computation for the epoch row, averaged over ranks (a collective): compute_time_s is the
    epoch's training time not spent in all-reduces; with a StepTimer, forward, backward and exposed comm time too."""
    timed = timer.take_epoch() if timer is not None else {}
    if monitor is None:
        return {"comm_time_s": 0.0, "compute_time_s": epoch_time, **timed}
    mine = {**monitor.take_epoch(), **timed}
    totals = torch.tensor(list(mine.values()), dtype=torch.float64, device=ctx.device)
    mean = dict(zip(mine, (ctx.all_reduce(totals, "sum") / ctx.world_size).tolist(), strict=True))
    row = {
        "comm_time_s": mean["comm_time_s"],
        "compute_time_s": max(epoch_time - mean["comm_time_s"], 0.0),
        "simulated_delay_s": mean["simulated_delay_s"],
        "comm_calls": round(mean["comm_buckets"]),
    }
    return row | {k: round(mean[k]) if k == "timed_micro_steps" else mean[k] for k in timed}


def comm_summary(model: torch.nn.Module, monitor: CommMonitor | None, dcfg) -> dict:
    """The gradient volume for metrics.json: the reducer's own buckets when there is one (as DDP handed them to the
    hook), else the buckets DDP would make on one process: parameters in reverse registration order (close to the
    order gradients become ready), the first bucket capped at DDP's first-bucket size and the rest at bucket_cap_mb."""
    reducer = monitor.layout if monitor is not None else []  # empty until a step has recorded them
    params: list[torch.Tensor] = [p for p in reversed(list(model.parameters())) if p.requires_grad]
    groups = ddp_buckets(params, dcfg.bucket_cap_mb) if params and not reducer else []
    layout = reducer or [_bucket_info(i, ps, ps) for i, ps in enumerate([params[j] for j in g] for g in groups)]
    return {
        "bucket_source": "reducer" if reducer else "computed",
        "grad_dtype": layout[0]["dtype"] if layout else None,
        "grad_bytes": sum(b["bytes"] for b in layout),
        "buckets": layout,
        "timed": getattr(monitor, "collectives", None),
        "comm_hook": dcfg.comm_hook,
        "powersgd_rank": POWERSGD_RANK if dcfg.comm_hook == "powersgd" else None,
        "simulated_latency_ms": dcfg.simulated_latency_ms,
        "simulated_bandwidth_mbps": dcfg.simulated_bandwidth_mbps,
    }
