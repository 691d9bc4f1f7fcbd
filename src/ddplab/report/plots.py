"""PNG plots of a set of runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ddplab.report.runs import Run


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series_label(run: Run) -> str:
    """What distinguishes this run's experiment, without the process count."""
    parts = [f"{k.split('.')[-1]}={v}" for k, v in run.swept.items()]
    return ", ".join(parts) or f"batch/proc {run.ddp.get('per_process')}"


def _groups(rows: list[dict], runs: list[Run]) -> dict[str, list[tuple[dict, Run]]]:
    """Rows of the same experiment (same config apart from processes), ordered by processes."""
    by_path = {str(r.path): r for r in runs}
    groups: dict[str, list] = defaultdict(list)
    for row in rows:
        run = by_path[row["path"]]
        groups[run.experiment_key()].append((row, run))
    out = {}
    for items in groups.values():
        label = _series_label(items[0][1])
        while label in out:  # runs outside a study may share a batch size but not a config
            label += "'"
        out[label] = sorted(items, key=lambda x: x[0]["processes"])
    return out


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def epoch_time_plot(rows, runs, path: Path) -> Path | None:
    series = {label: [(r["processes"], r["mean_epoch_time_s"]) for r, _ in items if r["mean_epoch_time_s"]]
              for label, items in _groups(rows, runs).items()}
    return _line_plot(series, path, xlabel="processes", ylabel="mean epoch time (s)",
                      title="Epoch time vs processes", size=(6.4, 4.2), legend=8)


def scaling_plot(rows, runs, path: Path) -> Path | None:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    drawn = False
    for label, items in _groups(rows, runs).items():
        pts = [(r["processes"], r["samples_per_s"], r["efficiency"]) for r, _ in items if r["samples_per_s"]]
        if not pts:
            continue
        procs = [p for p, _, _ in pts]
        line, = left.plot(procs, [s for _, s, _ in pts], marker="o", label=label)
        base = next((r["samples_per_s"] for r, _ in items if r["processes"] == 1 and r["samples_per_s"]), None)
        if base:
            left.plot(procs, [base * p for p in procs], linestyle="--", color=line.get_color(), alpha=0.6)
        eff = [(p, e) for p, _, e in pts if e is not None]
        if eff:
            right.plot(*zip(*eff), marker="o", color=line.get_color(), label=label)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    right.axhline(1.0, linestyle="--", color="grey", label="ideal")
    left.plot([], [], linestyle="--", color="grey", label="ideal (linear)")
    left.set(xlabel="processes", ylabel="training samples/s", title="Throughput vs processes")
    right.set(xlabel="processes", ylabel="scaling efficiency (speedup / processes)", title="Efficiency vs processes",
              ylim=(0, max(1.1, right.get_ylim()[1])))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def loss_plots(runs: list[Run], out: Path) -> list[Path]:
    """Train (solid) and validation (dashed) loss per run, over epochs and over training time."""
    plt = _pyplot()
    paths = []
    for axis, xlabel, fname in (("epoch", "epoch", "loss_epochs.png"), ("elapsed_s", "training time (s)", "loss_time.png")):
        fig, ax = plt.subplots(figsize=(7, 4.4))
        for run in runs:
            color = None
            if axis == "elapsed_s" and run.steps:
                # Per log interval: finer than per epoch.
                line, = ax.plot([s["elapsed_s"] for s in run.steps], [s["loss"] for s in run.steps], label=f"{run.name} train")
                color = line.get_color()
            else:
                pts = [(r[axis], r["train_loss"]) for r in run.epochs if r.get("train_loss") is not None]
                if pts:
                    line, = ax.plot(*zip(*pts), marker=".", label=f"{run.name} train")
                    color = line.get_color()
            val = [(r[axis], r["val_loss"]) for r in run.epochs if r.get("val_loss") is not None]
            if val:
                ax.plot(*zip(*val), marker="o", linestyle="--", color=color, label=f"{run.name} val")
        ax.set(xlabel=xlabel, ylabel="loss", title=f"Loss vs {xlabel}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        paths.append(_save(fig, out / fname))
    return paths


def accuracy_plot(runs: list[Run], path: Path) -> Path | None:
    series = {run.name: [(r["elapsed_s"], r["val_accuracy"]) for r in run.epochs if r.get("val_accuracy") is not None]
              for run in runs}
    return _line_plot(series, path, xlabel="training time (s)", ylabel="validation accuracy",
                      title="Accuracy vs training time", size=(7, 4.4), legend=7)


def _line_plot(series: dict, path: Path, *, xlabel: str, ylabel: str, title: str, size: tuple, legend: int) -> Path | None:
    """One marked line per label; no file when no series has a point."""
    series = {label: pts for label, pts in series.items() if pts}
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=size)
    for label, pts in series.items():
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend)
    return _save(fig, path)


def comm_plot(rows: list[dict], path: Path) -> Path | None:
    """Per step: time with a gradient all-reduce in flight vs the rest of the step."""
    rows = [r for r in rows if r.get("comm_ms_per_step") is not None]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4.4))
    names = [r["point"] for r in rows]
    comm = [r["comm_ms_per_step"] for r in rows]
    compute = [r["compute_ms_per_step"] or 0.0 for r in rows]
    ax.bar(names, compute, label="compute (rest of the step)")
    ax.bar(names, comm, bottom=compute, label="communication (all-reduce in flight)")
    ax.set(ylabel="ms per optimizer step", title="Communication vs computation")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.legend(fontsize=8)
    return _save(fig, path)
