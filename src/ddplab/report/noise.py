"""Points that differ in one thing only, compared on throughput: where their ranges over repeats overlap, the
difference is called within noise instead of a ranking."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

from ddplab.report.table import cell, swept_keys


def compare(a: dict, b: dict, key: str = "samples_per_s") -> str:
    """One sentence on two points' medians: a ratio only when their ranges are apart."""
    va, vb = a.get(key), b.get(key)
    head = f"{a['label']} {cell(a, key)} vs {b['label']} {cell(b, key)}"
    if not va or not vb:
        return f"{head}: not measured"
    if min(a.get("repeats", 1), b.get("repeats", 1)) < 2:
        return f"{head}: a single run on a side, noise not measured (use --repeat 3)"
    # build_rows gives every measured median its range over the repeats
    if a[f"{key}_min"] <= b[f"{key}_max"] and b[f"{key}_min"] <= a[f"{key}_max"]:
        return f"{head}: **within noise** (ranges overlap)"
    faster, slower = (a, b) if va > vb else (b, a)
    return f"{head}: {faster['label']} is {max(va, vb) / min(va, vb):.2f}x {slower['label']} (ranges apart)"


def comparisons(rows: list[dict], key: str = "samples_per_s") -> list[str]:
    """Neighbouring points along each factor they vary in, the other factors held equal."""
    lines = []
    factors = [f for f in ["setup", *swept_keys(rows)] if len({r.get(f) for r in rows}) > 1]
    for factor in factors:
        others = [f for f in factors if f != factor]
        held: dict[tuple, list[dict]] = defaultdict(list)
        for row in rows:
            held[tuple(row.get(f) for f in others)].append(row)
        for group in held.values():
            for a, b in pairwise(group):
                lines.append(compare(a, b, key))
    return lines


def efficiency_notes(rows: list[dict]) -> list[str]:
    """An efficiency above 1 is almost always noise on a shared machine: say when it is."""
    notes = []
    for row in rows:
        eff, lo = row.get("efficiency"), row.get("efficiency_min")
        if eff is not None and eff > 1.0 and row.get("processes", 1) > 1:
            if row.get("repeats", 1) > 1 and lo is not None and lo <= 1.0:
                notes.append(f"{row['label']}: efficiency {cell(row, 'efficiency')} above 1 is within noise")
            else:
                notes.append(
                    f"{row['label']}: efficiency {cell(row, 'efficiency')} above 1 (superlinear, or the "
                    f"1-process baseline ran slow; repeat to tell)"
                )
    return notes
