"""The step-time model: compute from the 1-process runs, each gradient bucket's all-reduce overlapped with the
backward pass as DDP does it (FSDP's gathers and reduce-scatters: forecast/sharded.py)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ddplab.config import link_delay_s
from ddplab.errors import UserError
from ddplab.forecast.links import Link, allreduce_s, wire_messages
from ddplab.forecast.sharded import sent_bytes, sharded_step
from ddplab.report.runs import Run

# Share of a step's model compute that is backward when a run did not time it (older runs):
# backward costs about twice the forward.
_BACKWARD_SHARE = 2 / 3


@dataclass
class Measured:
    """One run reduced to what the model needs; times per optimizer step, in seconds."""

    name: str
    nodes: int
    per_node: int
    batch: int  # per process
    accum: int
    train_samples: int
    steps_per_epoch: int
    epoch_times: list[float]
    forward: float | None  # per micro-step
    backward: float | None
    data_wait: float
    latency_ms: float
    bandwidth_mbps: float | None
    hook: str
    buckets: list[dict] = field(default_factory=list)
    strategy: str = "ddp"
    units: list[dict] = field(default_factory=list)  # FSDP's, as run or as fsdp would shard the model

    @property
    def processes(self) -> int:
        return self.nodes * self.per_node

    @property
    def epoch_s(self) -> float:
        return statistics.median(self.epoch_times)

    @property
    def step_s(self) -> float:
        return self.epoch_s / self.steps_per_epoch


def measure(run: Run) -> Measured | None:
    """None for a run without a full epoch."""
    rows = [r for r in run.full_epochs if r.get("epoch_time_s")]
    steps = int(run.ddp.get("steps_per_epoch") or 0)
    if not rows or steps < 1:
        return None
    dist_cfg = run.summary.get("config", {}).get("distributed", {})
    micro = sum(r.get("timed_micro_steps") or 0 for r in rows)

    def per_micro(key):
        return sum(r[key] for r in rows) / micro if micro and all(key in r for r in rows) else None

    comm = run.summary.get("comm", {})
    return Measured(
        name=run.name,
        nodes=run.nodes,
        per_node=max(1, run.processes // run.nodes),
        batch=int(run.ddp.get("per_process", 1)),
        accum=int(run.ddp.get("grad_accum_steps", 1)),
        train_samples=int(run.summary.get("dataset", {}).get("train") or 0),
        steps_per_epoch=steps,
        epoch_times=[r["epoch_time_s"] for r in rows],
        forward=per_micro("forward_time_s"),
        backward=per_micro("backward_time_s"),
        data_wait=sum(r.get("data_wait_s") or 0.0 for r in rows) / (steps * len(rows)),
        latency_ms=float(dist_cfg.get("simulated_latency_ms") or 0.0),
        bandwidth_mbps=dist_cfg.get("simulated_bandwidth_mbps"),
        hook=comm.get("comm_hook") or dist_cfg.get("comm_hook") or "none",
        buckets=comm.get("buckets", []),
        strategy=run.ddp.get("strategy") or "ddp",
        units=comm.get("units", []),
    )


def _linear(xs: Sequence[float], ys: Sequence[float], proportional: bool) -> tuple[float, float]:
    """(a, c) of y = a + c * x: least squares through each distinct x's median (a repeat slowed by other jobs
    does not pull the line); from one x, all proportional to x or all constant."""
    by_x = {x: statistics.median(y for xi, y in zip(xs, ys, strict=True) if xi == x) for x in set(xs)}
    if len(by_x) >= 2:
        c, a = np.polyfit(list(by_x), list(by_x.values()), 1)
        return float(a), float(c)
    ((x, y),) = by_x.items()
    return (0.0, y / x) if proportional else (y, 0.0)


@dataclass
class Compute:
    """Per optimizer step on one process, a + c * batch for each part (forward and backward per micro-batch)."""

    forward: tuple[float, float]
    backward: tuple[float, float]
    data_wait: tuple[float, float]
    rest: tuple[float, float]
    timed: bool  # forward/backward were measured (else split by _BACKWARD_SHARE)

    def part(self, name: str, batch: int) -> float:
        a, c = getattr(self, name)
        return max(a + c * batch, 0.0)

    def step_s(self, batch: int, accum: int = 1, scale: float = 1.0) -> float:
        """A step with nothing to communicate."""
        micro = self.part("forward", batch) + self.part("backward", batch)
        return scale * (accum * micro + self.part("rest", batch)) + self.part("data_wait", batch)


def fit_compute(singles: list[Measured]) -> Compute:
    if not singles:
        raise UserError(
            "forecast: no 1-process run among the runs given; the compute model needs one "
            "(e.g. ddplab study ... --nproc 1,2)"
        )
    xs = [m.batch for m in singles]
    timed = all(m.forward is not None and m.backward is not None for m in singles)
    parts = []  # (forward, backward, the rest) of each run's step
    for m in singles:
        model_s = m.step_s - m.data_wait
        untimed = ((1 - _BACKWARD_SHARE) * model_s / m.accum, _BACKWARD_SHARE * model_s / m.accum)
        f, b = (m.forward, m.backward) if timed and m.forward is not None and m.backward is not None else untimed
        parts.append((f, b, max(model_s - m.accum * (f + b), 0.0)))
    fwd, bwd, rest = zip(*parts, strict=True)
    return Compute(
        forward=_linear(xs, fwd, True),
        backward=_linear(xs, bwd, True),
        data_wait=_linear(xs, [m.data_wait for m in singles], True),
        rest=_linear(xs, rest, False),
        timed=timed,
    )


@dataclass
class Comm:
    """What one step communicates: ddp's buckets under a hook, or fsdp/hsdp's units (where a run recorded
    none, its buckets in forward order stand in)."""

    buckets: list[dict]
    hook: str = "none"
    rank: int = 1
    strategy: str = "ddp"
    units: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.units = self.units or self.buckets[::-1]


def overlapped_backward(
    backward_s: float, buckets: list[dict], messages: list[list[float]], cost, delays: list[float] | None = None
) -> tuple[float, float, float]:
    """(backward end incl. communication, total all-reduce time, exposed all-reduce time): buckets are ready in
    order at a pace proportional to their bytes, their all-reduces run one after another; a simulated delay
    sleeps on the backward thread itself, holding back every later gradient as well as its own bucket."""
    delays = delays or [0.0] * len(buckets)
    total = sum(b["bytes"] for b in buckets) or 1
    done = shift = free = comm = 0.0
    for bucket, msgs, delay in zip(buckets, messages, delays, strict=True):
        done += bucket["bytes"]
        ready = backward_s * done / total + shift + delay
        shift += delay
        cost_s = sum(cost(m) for m in msgs)
        comm += cost_s
        free = max(ready, free) + cost_s
    compute_end = backward_s + shift
    end = max(compute_end, free)
    return end, comm, end - compute_end


@dataclass
class StepForecast:
    step_s: float
    compute_s: float  # the step without any communication
    comm_s: float  # all-reduce time, hidden or not
    exposed_s: float  # all-reduce time not hidden behind backward (incl. simulated delays)
    sent_bytes: float = 0.0  # per rank


def predict_step(
    compute: Compute,
    comm: Comm,
    nodes: int,
    per_node: int,
    batch: int,
    inter: Link,
    intra: Link,
    accum: int = 1,
    scale: float = 1.0,
    latency_ms: float = 0.0,
    bandwidth_mbps: float | None = None,
) -> StepForecast:
    """One optimizer step of nodes x per_node processes with `batch` samples per process."""
    p = nodes * per_node
    base = compute.step_s(batch, accum, 1.0 if p == 1 else scale)
    if p == 1:
        return StepForecast(base, base, 0.0, 0.0)
    backward = scale * compute.part("backward", batch)
    if comm.strategy != "ddp":
        forward = scale * compute.part("forward", batch)
        added, comm_s = sharded_step(forward, backward, comm.units, comm.strategy, nodes, per_node, inter, intra, accum)
        sent = sent_bytes(comm.strategy, sum(u["bytes"] for u in comm.units), nodes, per_node, accum)
        return StepForecast(base + added, base, comm_s, added, sent)
    messages = [wire_messages(b, comm.hook, comm.rank) for b in comm.buckets]
    # The simulated link delays the bucket's wire size (the uncompressed size under PowerSGD).
    sizes = [b["bytes"] if comm.hook == "powersgd" else sum(m) for b, m in zip(comm.buckets, messages, strict=True)]
    delays = [link_delay_s(n, p, latency_ms, bandwidth_mbps) for n in sizes]
    end, comm_s, exposed = overlapped_backward(
        backward, comm.buckets, messages, lambda n: allreduce_s(n, nodes, per_node, inter, intra), delays
    )
    sent = sent_bytes("ddp", sum(sum(m) for m in messages), nodes, per_node, accum)
    return StepForecast(base - backward + end, base, comm_s + sum(delays), exposed, sent)
