"""FSDP's traffic in the step-time model: each unit's parameters all-gathered before its forward and its
backward (every micro-step), its gradients reduce-scattered after the last backward: (2 x accumulation + 1)
x (p-1)/p x the parameter bytes per rank and step, against DDP's 2 (p-1)/p. hsdp stays within a node, then
all-reduces each gradient shard across nodes."""

from __future__ import annotations

from ddplab.forecast.links import Link, allreduce_s, ring_allreduce_s

STRATEGIES = ("ddp", "fsdp", "hsdp")


def costs(strategy: str, nodes: int, per_node: int, inter: Link, intra: Link):
    """(gather, reduce): seconds to all-gather a unit's parameters and to reduce its gradients."""

    def gather(n):
        # One of a ring all-reduce's two phases, (p-1)/p of the bytes sent: half its cost. hsdp's stay in the node.
        if strategy == "hsdp":
            return ring_allreduce_s(n, per_node, intra) / 2
        return allreduce_s(n, nodes, per_node, inter, intra) / 2

    def reduce(n):
        # hsdp: the node's gradient shards are then all-reduced across nodes together, over the node's link.
        return gather(n) + (ring_allreduce_s(n, nodes, inter) if strategy == "hsdp" else 0.0)

    return gather, reduce


def gathered_pass(compute_s: float, units: list[dict], gather, reduce=None) -> tuple[float, float]:
    """(end, communication seconds) of one pass over FSDP's units: the next unit's gather is issued as a unit
    starts computing (FSDP2 prefetches one ahead); with `reduce`, each unit's gradients are reduced as its
    compute ends. Compute is spread over the units in proportion to their bytes."""
    total = sum(u["bytes"] for u in units) or 1
    ready = comm = gather(units[0]["bytes"])
    t = reduced = 0.0
    for i, unit in enumerate(units):
        start = max(t, ready)
        if i + 1 < len(units):
            cost = gather(units[i + 1]["bytes"])
            comm += cost
            ready = start + cost
        t = start + compute_s * unit["bytes"] / total
        if reduce is not None:
            cost = reduce(unit["bytes"])
            comm += cost
            reduced = max(t, reduced) + cost
    return max(t, reduced), comm


def sharded_step(
    fwd: float,
    bwd: float,
    units: list[dict],
    strategy: str,
    nodes: int,
    per_node: int,
    inter: Link,
    intra: Link,
    accum: int,
) -> tuple[float, float]:
    """(seconds a step's communication adds to its compute, communication seconds in all) for
    `accum` micro-steps of forward `fwd` and backward `bwd` seconds."""
    gather, reduce = costs(strategy, nodes, per_node, inter, intra)
    back = units[::-1]
    f_end, f_comm = gathered_pass(fwd, units, gather)
    b_end, b_comm = gathered_pass(bwd, back, gather)
    s_end, s_comm = gathered_pass(bwd, back, gather, reduce)
    added = accum * (f_end - fwd) + (accum - 1) * (b_end - bwd) + (s_end - bwd)
    return added, accum * f_comm + (accum - 1) * b_comm + s_comm


def sent_bytes(strategy: str, nbytes: float, nodes: int, per_node: int, accum: int) -> float:
    """Bytes each rank sends per step: `nbytes` is the parameter (= gradient) bytes, or for ddp
    the gradient's bytes on the wire under its hook."""
    p = nodes * per_node
    if strategy == "ddp":
        return 2 * (p - 1) / p * nbytes
    if strategy == "fsdp":
        return (2 * accum + 1) * (p - 1) / p * nbytes
    return (2 * accum + 1) * (per_node - 1) / per_node * nbytes + 2 * (nodes - 1) / nodes * nbytes / per_node
