"""DDP communication hooks: compression (fp16, bf16, PowerSGD) from torch itself, a simulated
wide-area link, and a timer that measures how long every bucket's all-reduce takes.

Every distributed run gets the timing hook, wrapped around the configured compression hook:

    timed( delayed( fp16 | bf16 | powersgd | plain all-reduce ) )

so communication time is recorded for every run, and a simulated delay composes with any
compression.
"""

import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

# Bytes each element of a bucket occupies on the wire, per compression hook. PowerSGD's
# low-rank payload depends on the tensor shapes; the uncompressed size is an upper bound.
_WIRE_BYTES = {"none": None, "fp16": 2, "bf16": 2, "powersgd": None}


def link_delay_s(nbytes: int, world_size: int, latency_ms: float, bandwidth_mbps: float | None) -> float:
    """Seconds a wide-area link adds to one all-reduce of `nbytes` per rank.

    A propagation delay per message, plus serialisation at the link's bandwidth of what a
    ring all-reduce sends per rank: 2 (N - 1) / N times the payload.
    """
    delay = latency_ms / 1000.0
    if bandwidth_mbps:
        sent = 2 * (world_size - 1) / world_size * nbytes
        delay += sent * 8 / (bandwidth_mbps * 1e6)
    return delay


class CommMonitor:
    """The hook state: time during which at least one gradient all-reduce was in flight.

    A bucket is in flight from the moment DDP hands it over (including any simulated
    delay) until its future completes. Buckets overlap one another and the backward pass
    of earlier layers, so the union of these intervals is counted, never their sum: it is
    the wall time spent communicating, whether or not compute hid part of it. On CUDA the
    future completes on the host once the result is ready for the stream, so times there
    are host-side.
    """

    def __init__(self, dcfg, world_size: int, inner=None, inner_state=None) -> None:
        self.latency_ms = dcfg.simulated_latency_ms
        self.bandwidth_mbps = dcfg.simulated_bandwidth_mbps
        self.wire_bytes = _WIRE_BYTES[dcfg.comm_hook]
        self.world_size = world_size
        self.inner = inner or default_hooks.allreduce_hook
        self.inner_state = inner_state if inner_state is not None else dist.group.WORLD
        self._lock = threading.Lock()  # futures complete on the backend's threads
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.comm_s = 0.0
            self.delay_s = 0.0
            self.buckets = 0
            self._in_flight = 0
            self._since = 0.0

    def take_epoch(self) -> dict:
        """This rank's totals since the last call; the counters start again from zero."""
        with self._lock:
            out = {"comm_time_s": self.comm_s, "simulated_delay_s": self.delay_s, "comm_buckets": self.buckets}
        self.reset()
        return out

    def _begin(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._since = time.perf_counter()
            self._in_flight += 1

    def _end(self, delay: float) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self.comm_s += time.perf_counter() - self._since
            self.delay_s += delay
            self.buckets += 1

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self._begin()
        delay = 0.0
        if self.latency_ms or self.bandwidth_mbps:
            buffer = bucket.buffer()
            nbytes = buffer.numel() * (self.wire_bytes or buffer.element_size())
            delay = link_delay_s(nbytes, self.world_size, self.latency_ms, self.bandwidth_mbps)
            # Sleeping on the backward thread holds back this bucket and every later one, as
            # a link that delivers messages in order would; every rank sleeps the same time.
            time.sleep(delay)
        fut = self.inner(self.inner_state, bucket)

        def done(f: torch.futures.Future) -> torch.Tensor:
            self._end(delay)
            return f.value()

        return fut.then(done)


def _monitor_hook(monitor: CommMonitor, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return monitor(bucket)


def install_comm_hook(model, dcfg, ctx) -> CommMonitor:
    """Register the timed (and optionally delayed) hook on a DDP model; returns its state,
    which the trainer keeps alive and asks for per-epoch communication time."""
    group = dist.group.WORLD
    inner, inner_state = default_hooks.allreduce_hook, group
    if dcfg.comm_hook == "fp16":
        inner = default_hooks.fp16_compress_hook
    elif dcfg.comm_hook == "bf16":
        inner = default_hooks.bf16_compress_hook
    elif dcfg.comm_hook == "powersgd":
        inner = powerSGD_hook.powerSGD_hook
        inner_state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                                  start_powerSGD_iter=2, min_compression_rate=2, random_seed=0)
    monitor = CommMonitor(dcfg, ctx.world_size, inner, inner_state)
    model.register_comm_hook(monitor, _monitor_hook)
    return monitor


def epoch_comm_row(monitor: CommMonitor | None, ctx, epoch_time: float) -> dict:
    """Communication vs computation for the epoch row, averaged over ranks (a collective).

    compute_time_s is the epoch's training time not spent in all-reduces; with one process
    there is nothing to communicate and all of it is compute.
    """
    if monitor is None:
        return {"comm_time_s": 0.0, "compute_time_s": epoch_time}
    mine = monitor.take_epoch()
    totals = torch.tensor([mine["comm_time_s"], mine["simulated_delay_s"], mine["comm_buckets"]],
                          dtype=torch.float64, device=ctx.device)
    comm, delay, calls = (ctx.all_reduce(totals, "sum") / ctx.world_size).tolist()
    return {"comm_time_s": comm, "compute_time_s": max(epoch_time - comm, 0.0), "simulated_delay_s": delay,
            "comm_calls": round(calls)}
