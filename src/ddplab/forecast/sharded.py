"""FSDP's traffic in the step-time model (distributed.strategy=fsdp | hsdp).

Where DDP all-reduces gradients once per step, FSDP all-gathers each unit's parameters before
its forward and again before its backward (every micro-step), and reduce-scatters its gradients
after its backward (the last micro-step only). Per rank and step that is (2 x accumulation + 1)
x (p-1)/p x the parameter bytes, against DDP's 2 (p-1)/p. hsdp gathers and scatters within a
node only, then all-reduces each gradient shard across nodes.
"""

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
    """(end, communication seconds) of one pass over FSDP's units in the order given: a unit
    computes once its parameters are gathered; the next unit's gather is issued as a unit starts
    computing (FSDP2 prefetches one ahead), gathers one after another. With `reduce`, each
    unit's gradients are reduced as its compute ends, one after another on their own stream.
    Compute is spread over the units in proportion to their bytes, as DDP's buckets are."""
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
