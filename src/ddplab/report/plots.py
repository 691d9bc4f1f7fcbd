"""PNG plots of a set of runs (matplotlib without pyplot: no display needed). Setups are categories, never a
numeric axis (1x2 and 2x1 are two points); points with repeats are drawn at their median with min-max bars."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from ddplab.metrics.class_report import save_png, subplots
from ddplab.report.runs import Run
from ddplab.report.table import swept_keys


def _legend(ax, **kw) -> None:
    """A legend where the panel has labelled lines (a panel with no point to draw has none)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)


def setup_order(rows: list[dict]) -> list[str]:
    """Setups by process count, then by nodes: 1x1, 1x2, 2x1, 1x4, 2x2."""
    seen = {r["setup"]: (r["processes"], r["nodes"]) for r in rows}
    return sorted(seen, key=lambda s: seen[s])


def _swept_label(row: dict, skip: str | None = None) -> str:
    parts = [f"{k.split('.')[-1]}={v}" for k, v in row.items() if k.startswith("swept:") and k != skip]
    return ", ".join(parts) or f"batch/proc {row.get('batch_per_process')}"


def _errorbar(ax, xs, rows, key, **kw):
    """Median with min-max whiskers; returns the line."""
    lo = [r[key] - (r[key] if r.get(f"{key}_min") is None else r[f"{key}_min"]) for r in rows]
    hi = [(r[key] if r.get(f"{key}_max") is None else r[f"{key}_max"]) - r[key] for r in rows]
    return ax.errorbar(xs, [r[key] for r in rows], yerr=[lo, hi], **{"marker": "o", "capsize": 3, **kw}).lines[0]


def _series(rows: list[dict], key: str, where: dict[str, int]) -> dict[str, list[dict]]:
    """The rows that have `key`, one list per combination of swept values, in setup order."""
    series: dict[str, list[dict]] = {_swept_label(r): [] for r in rows}
    for row in sorted(rows, key=lambda r: where[r["setup"]]):
        if row.get(key):
            series[_swept_label(row)].append(row)
    return {label: items for label, items in series.items() if items}


def setups_plots(rows: list[dict], out: Path) -> list[Path]:
    """epoch_time.png and scaling.png (throughput with the ideal line, efficiency), one line per swept combination."""
    order = setup_order(rows)
    where = {s: i for i, s in enumerate(order)}
    paths = []
    timed = _series(rows, "mean_epoch_time_s", where)
    if timed:
        fig, ax = subplots(figsize=(6.4, 4.2))
        for label, items in timed.items():
            _errorbar(ax, [where[r["setup"]] for r in items], items, "mean_epoch_time_s", label=label)
        _categories(ax, order)
        ax.set(ylabel="mean epoch time (s)", title="Epoch time per setup")
        _legend(ax, fontsize=8)
        paths.append(save_png(fig, out / "epoch_time.png"))
    rated = _series(rows, "samples_per_s", where)
    if not rated:
        return paths
    fig, (left, right) = subplots(1, 2, figsize=(11, 4.2))
    for label, items in rated.items():
        xs = [where[r["setup"]] for r in items]
        line = _errorbar(left, xs, items, "samples_per_s", label=label)
        base = next((r for r in items if r["processes"] == 1), None)
        if base:
            ideal = [base["samples_per_s"] * r["processes"] for r in items]
            left.plot(xs, ideal, linestyle="--", color=line.get_color(), alpha=0.6)
        eff = [r for r in items if r.get("efficiency") is not None]
        if eff:
            _errorbar(right, [where[r["setup"]] for r in eff], eff, "efficiency", color=line.get_color(), label=label)
    right.axhline(1.0, linestyle="--", color="grey", label="ideal")
    left.plot([], [], linestyle="--", color="grey", label="ideal (linear in processes)")
    left.set(ylabel="training samples/s", title="Throughput per setup")
    top = max(1.1, right.get_ylim()[1])
    right.set(ylabel="scaling efficiency (speedup / processes)", title="Efficiency per setup", ylim=(0, top))
    for ax in (left, right):
        _categories(ax, order)
        _legend(ax, fontsize=8)
    paths.append(save_png(fig, out / "scaling.png"))
    return paths


def _categories(ax, order: list[str]) -> None:
    ax.set_xticks(range(len(order)), order)
    ax.set_xlim(-0.5, len(order) - 0.5)
    ax.set_xlabel("setup (nodes x processes per node)")
    ax.grid(alpha=0.3)


def sweep_plots(rows: list[dict], out: Path) -> list[Path]:
    """For each swept key with several values: epoch time, samples/s and the communication share of a step
    against the swept value, one line per setup and combination of the other swept values."""
    keys = [k for k in swept_keys(rows) if len({r.get(k) for r in rows}) > 1]
    for r in rows:
        if r.get("comm_ms_per_step") is not None and r.get("compute_ms_per_step") is not None:
            total = r["comm_ms_per_step"] + r["compute_ms_per_step"]
            r["comm_share"] = r["comm_ms_per_step"] / total if total else None  # the median only: no range kept
    paths = []
    for key in keys:
        leaf = key.split(":", 1)[1]
        values = list(dict.fromkeys(r[key] for r in rows if r.get(key) is not None))
        try:
            values = [v for _, v in sorted((float(v), v) for v in values)]
            numbers = [float(v) for v in values]
        except ValueError:
            numbers = None
        where = dict(zip(values, numbers or range(len(values)), strict=True))
        panels = [("mean_epoch_time_s", "mean epoch time (s)"), ("samples_per_s", "training samples/s")]
        if any(r.get("comm_ms_per_step") for r in rows):
            panels.append(("comm_share", "communication share of a step"))
        fig, axes = subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2))
        for ax, (metric, ylabel) in zip(axes, panels, strict=True):
            series: dict[str, list[dict]] = defaultdict(list)
            for r in rows:
                if r.get(metric) is not None and r.get(key) in where:
                    rest = _swept_label(r, skip=key)
                    series[r["setup"] + ("" if rest.startswith("batch/proc") else f", {rest}")].append(r)
            for label in sorted(series):
                items = sorted(series[label], key=lambda r: where[r[key]])
                _errorbar(ax, [where[r[key]] for r in items], items, metric, label=label)
            if numbers and min(numbers) > 0 and max(numbers) / min(numbers) >= 8:
                ax.set_xscale("log", base=2)
            ax.set_xticks(list(where.values()), list(where))
            ax.minorticks_off()
            ax.set(xlabel=leaf, ylabel=ylabel, title=f"{ylabel.split(' (')[0]} vs {leaf.split('.')[-1]}")
            ax.grid(alpha=0.3)
            _legend(ax, fontsize=8, title="setup")
        paths.append(save_png(fig, out / f"vs_{leaf.split('.')[-1]}.png"))
    return paths


def _median_curve(runs: list[Run], key: str) -> list[dict]:
    """Per epoch, the median of a value over a point's repeats with its min and max."""
    per_epoch: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        for r in run.epochs:
            if r.get(key) is not None and not r.get("partial"):
                per_epoch[int(r["epoch"])].append(r[key])
    return [
        {"epoch": e, key: statistics.median(v), f"{key}_min": min(v), f"{key}_max": max(v)}
        for e, v in sorted(per_epoch.items())
    ]


def _points(runs: list[Run]) -> dict[str, list[Run]]:
    points: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        points[run.label if run.point else run.name].append(run)
    return points


def _firsts(runs: list[Run]) -> dict[str, Run]:
    return {name: min(group, key=lambda r: r.repeat) for name, group in _points(runs).items()}


def val_epoch_plot(runs: list[Run], path: Path) -> Path | None:
    """Validation accuracy and F1 over epochs, one line per point, median over repeats with min-max bars."""
    metrics = [k for k in ("val_accuracy", "val_f1") if any(r.get(k) is not None for run in runs for r in run.epochs)]
    if not metrics:
        return None
    points = _points(runs)
    # Colour by swept values, line style by setup: setups that train identically (1x2 and 2x1
    # with the same seed) draw on top of each other and stay visible.
    swept = list(dict.fromkeys(json.dumps(g[0].swept, sort_keys=True) for g in points.values()))
    setups = sorted({g[0].setup for g in points.values()}, key=lambda s: [int(x) for x in s.split("x")])
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
    fig, axes = subplots(1, len(metrics), figsize=(6.2 * len(metrics), 4.4), squeeze=False)
    for ax, key in zip(axes[0], metrics, strict=True):
        for label, group in points.items():
            curve = _median_curve(group, key)
            if curve:
                line, marker = styles[setups.index(group[0].setup) % len(styles)]
                color = f"C{swept.index(json.dumps(group[0].swept, sort_keys=True))}"  # the colour cycle's, wrapped
                _errorbar(
                    ax, [c["epoch"] for c in curve], curve, key, marker=marker, linestyle=line, color=color, label=label
                )
        ax.locator_params(axis="x", integer=True)
        name = {"val_accuracy": "validation accuracy", "val_f1": "validation F1 (macro)"}[key]
        ax.set(xlabel="epoch", ylabel=name, title=f"{name[0].upper()}{name[1:]} per epoch")
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=7)
    return save_png(fig, path)


def loss_plots(runs: list[Run], out: Path) -> list[Path]:
    """Train (solid) and validation (dashed) loss of each point's first repeat, over epochs and training time."""
    paths = []
    views = (("epoch", "epoch", "loss_epochs.png"), ("elapsed_s", "training time (s)", "loss_time.png"))
    for axis, xlabel, fname in views:
        fig, ax = subplots(figsize=(7, 4.4))
        for name, run in _firsts(runs).items():
            if axis == "elapsed_s" and run.steps:  # per log interval: finer than per epoch
                pts, marker = [(s["elapsed_s"], s["loss"]) for s in run.steps], None
            else:
                pts, marker = [(r[axis], r["train_loss"]) for r in run.epochs if r.get("train_loss") is not None], "."
            drawn = ax.plot(*zip(*pts, strict=True), marker=marker, label=f"{name} train") if pts else []
            color = drawn[0].get_color() if drawn else None
            val = [(r[axis], r["val_loss"]) for r in run.epochs if r.get("val_loss") is not None]
            if val:
                ax.plot(*zip(*val, strict=True), marker="o", linestyle="--", color=color, label=f"{name} val")
        if axis == "epoch":
            ax.locator_params(axis="x", integer=True)
        ax.set(xlabel=xlabel, ylabel="loss", title=f"Loss vs {xlabel} (first repeat of each point)")
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=7, ncol=2)
        paths.append(save_png(fig, out / fname))
    return paths


def accuracy_plot(runs: list[Run], path: Path) -> Path | None:
    fig, ax = subplots(figsize=(7, 4.4))
    for name, run in _firsts(runs).items():
        if pts := [(r["elapsed_s"], r["val_accuracy"]) for r in run.epochs if r.get("val_accuracy") is not None]:
            ax.plot(*zip(*pts, strict=True), marker="o", label=name)
    if not ax.lines:
        return None
    ax.set(xlabel="training time (s)", ylabel="validation accuracy", title="Accuracy vs training time (first repeat)")
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=7)
    return save_png(fig, path)


def comm_plot(rows: list[dict], path: Path) -> Path | None:
    """Per step: time with a collective in flight vs the rest of the step (medians)."""
    rows = [r for r in rows if r.get("comm_ms_per_step") is not None]
    if not rows:
        return None
    fig, ax = subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4.4))
    names = [r["label"] for r in rows]
    compute = [r["compute_ms_per_step"] or 0.0 for r in rows]
    ax.bar(names, compute, label="compute (rest of the step)")
    ax.bar(names, [r["comm_ms_per_step"] for r in rows], bottom=compute, label="communication (a collective in flight)")
    ax.set(ylabel="ms per optimizer step (median over repeats)", title="Communication vs computation per point")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    _legend(ax, fontsize=8)
    return save_png(fig, path)
