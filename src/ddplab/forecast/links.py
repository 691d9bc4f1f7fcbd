"""Links and the all-reduce cost model: latency-bandwidth (alpha-beta) for a ring, hierarchical
across nodes, and the bytes each communication hook puts on the wire."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ddplab.errors import UserError

# Prefixes of bandwidth units; bits are written 'bit', 'bit/s' or 'bps', bytes 'B/s' (capital B).
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30}
_LATENCY_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_QUANTITY = re.compile(r"^\s*([-+]?\d+(?:\.\d*)?(?:e[-+]?\d+)?|[-+]?\.\d+)\s*([a-zA-Zµ/]+)\s*$")


def _split(text: str, option: str, example: str) -> tuple[float, str]:
    match = _QUANTITY.match(str(text))
    if not match:
        raise UserError(f"{option}: expected a number with a unit like {example}, got {text!r}")
    return float(match.group(1)), match.group(2)


def parse_bandwidth(text: str, option: str = "--bandwidth") -> float:
    """'25Gbit', '10Gbps', '100Mbit/s', '200GB/s', '1GiB/s' -> bytes per second."""
    number, unit = _split(text, option, "25Gbit or 200GB/s")
    low = unit.lower()
    bits = re.fullmatch(r"([kmgt]?)(?:bit/s|bit|bps)", low)
    if unit.endswith("B/s"):  # bytes
        scale = _PREFIX.get(low[:-3]) or _BINARY.get(low[:-3])
    else:
        scale = _PREFIX[bits.group(1)] / 8 if bits else None
    if scale is None:
        raise UserError(f"{option}: unknown unit {unit!r} in {text!r} (use Mbit, Gbit, Gbps, MB/s, GB/s)")
    value = number * scale
    if not value > 0 or not math.isfinite(value):
        raise UserError(f"{option} must be positive, got {text!r}")
    return value


def parse_latency(text: str, option: str = "--latency") -> float:
    """'50us', '1.5ms', '0.2s' -> seconds (zero allowed)."""
    number, unit = _split(text, option, "50us or 2ms")
    if unit not in _LATENCY_UNITS:
        raise UserError(f"{option}: unknown unit {unit!r} in {text!r} (use ns, us, ms, s)")
    if number < 0 or not math.isfinite(number):
        raise UserError(f"{option} must be >= 0, got {text!r}")
    return number * _LATENCY_UNITS[unit]


@dataclass(frozen=True)
class Link:
    """alpha: seconds per message; bandwidth: bytes per second each way per process."""

    alpha: float
    bandwidth: float

    def describe(self) -> str:
        return f"latency {self.alpha * 1e6:,.0f} us, bandwidth {format_bandwidth(self.bandwidth)}"


def format_bandwidth(bytes_per_s: float) -> str:
    if math.isinf(bytes_per_s):
        return "unlimited"
    bits = bytes_per_s * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def ring_allreduce_s(nbytes: float, processes: int, link: Link) -> float:
    """A ring all-reduce (reduce-scatter then all-gather): 2 (p-1) steps, each a message of
    nbytes / p, so 2 (p-1)/p * nbytes / bandwidth + 2 (p-1) * alpha. Nothing to do for p = 1."""
    if processes <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (processes - 1) / processes * nbytes / link.bandwidth + 2 * (processes - 1) * link.alpha


def allreduce_s(nbytes: float, nodes: int, per_node: int, inter: Link, intra: Link) -> float:
    """Hierarchical all-reduce: reduce-scatter inside each node, an all-reduce across nodes of each process's
    shard (the shards' rings share the node's link: the whole payload's ring volume), then all-gather."""
    return ring_allreduce_s(nbytes, per_node, intra) + ring_allreduce_s(nbytes, nodes, inter)


def wire_messages(bucket: dict, hook: str, rank: int = 1) -> list[float]:
    """Bytes of each all-reduce one gradient bucket costs under a hook; powersgd: matrices that compress at
    least 2x become factors P (rows x rank) and Q (cols x rank), the rest one uncompressed all-reduce."""
    elem = bucket["bytes"] / bucket["numel"] if bucket["numel"] else 4
    if hook == "none":
        return [float(bucket["bytes"])]
    if hook in ("fp16", "bf16"):
        return [2.0 * bucket["numel"]]
    if hook == "powersgd":
        p_elems = q_elems = compressed = 0
        for rows, cols in bucket.get("matrices", []):
            if rows * cols >= 2 * (rows + cols) * rank:
                p_elems += rows * rank
                q_elems += cols * rank
                compressed += rows * cols
        rest = bucket["numel"] - compressed
        return [m * elem for m in (rest, p_elems, q_elems) if m > 0]
    raise UserError(f"unknown communication hook {hook!r} (none, fp16, bf16, powersgd[:RANK])")


def parse_hook(text: str | None) -> tuple[str | None, int]:
    """'fp16', 'powersgd', 'powersgd:4' -> (hook, powersgd rank)."""
    if text is None:
        return None, 1
    name, _, rank = text.partition(":")
    if name not in ("none", "fp16", "bf16", "powersgd") or (
        rank and (name != "powersgd" or not rank.isdigit() or int(rank) < 1)
    ):
        raise UserError(f"--comm-hook: expected none, fp16, bf16, powersgd or powersgd:RANK, got {text!r}")
    return name, int(rank) if rank else 1
