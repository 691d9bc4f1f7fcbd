"""One row per run: batch arithmetic, timing, speedup and scaling efficiency, quality.

Speedup is measured from throughput: training samples/s of a run divided by that of the
1-process run of the same experiment (equal config apart from naming, so the same
per-process batch and learning-rate rule). Efficiency = speedup / processes.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from ddplab.report.runs import Run

# (key, markdown header); the CSV uses the keys.
COLUMNS = [
    ("point", "point"), ("setup", "setup (nodes x procs)"), ("processes", "processes"),
    ("batch_per_process", "batch / process"), ("global_batch", "global batch"), ("lr", "lr"),
    ("steps_per_epoch", "steps / epoch"), ("epochs", "epochs"), ("mean_epoch_time_s", "mean epoch time (s)"),
    ("samples_per_s", "samples/s"), ("speedup", "speedup"), ("efficiency", "efficiency"),
    ("comm_ms_per_step", "comm ms/step"), ("compute_ms_per_step", "compute ms/step"),
    ("epochs_at_budget", "epochs @ budget"), ("best_val_loss", "best val loss"), ("test_loss", "test loss"),
    ("test_accuracy", "test accuracy"),
]
GPU_COLUMNS = [("gpu_util", "GPU util %"), ("gpu_mem_mb", "GPU mem (MiB)")]


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def epochs_within(run: Run, budget_s: float) -> float | None:
    """Epochs (fractional) trained when `budget_s` seconds of training time had passed."""
    spe = run.ddp.get("steps_per_epoch")
    if not spe:
        return None
    marks = [(r["elapsed_s"], r["step"]) for r in run.steps + run.epochs if r.get("elapsed_s") is not None]
    reached = [step for elapsed, step in marks if elapsed <= budget_s * (1 + 1e-9)]
    return max(reached, default=0) / spe


def default_budget(runs: list[Run]) -> float:
    """The training time of the run that trained least: every run had at least that long."""
    times = [r.summary.get("aggregates", {}).get("train_time_s") for r in runs]
    return min(t for t in times if t) if any(times) else 0.0


def baselines(runs: list[Run]) -> dict[str, Run]:
    """The first 1-process run of each experiment."""
    base: dict[str, Run] = {}
    for run in runs:
        if run.processes == 1:
            base.setdefault(run.experiment_key(), run)
    return base


def build_rows(runs: list[Run], budget_s: float) -> list[dict]:
    base = baselines(runs)
    rows = []
    for run in runs:
        epochs = run.full_epochs or run.epochs
        rate = _mean(r.get("samples_per_s") for r in epochs)
        ref = base.get(run.experiment_key())
        ref_epochs = ref.full_epochs or ref.epochs if ref else []
        ref_rate = _mean(r.get("samples_per_s") for r in ref_epochs)
        speedup = rate / ref_rate if rate and ref_rate else None
        steps = run.total_steps
        comm = sum(r.get("comm_time_s") or 0.0 for r in run.epochs)
        compute = sum(r.get("compute_time_s") or 0.0 for r in run.epochs)
        has_comm = any(r.get("comm_time_s") is not None for r in run.epochs)
        test = run.summary.get("test", {})
        row = {
            "point": run.name, "path": str(run.path), "setup": run.setup, "processes": run.processes,
            "nodes": run.nodes, **{f"swept:{k}": v for k, v in run.swept.items()},
            "batch_per_process": run.ddp.get("per_process"), "grad_accum_steps": run.ddp.get("grad_accum_steps"),
            "global_batch": run.ddp.get("global"), "lr": run.ddp.get("lr"), "lr_scaling": run.ddp.get("lr_scaling"),
            "steps_per_epoch": run.ddp.get("steps_per_epoch"), "epochs": len(run.full_epochs), "steps": steps,
            "mean_epoch_time_s": _mean(r.get("epoch_time_s") for r in run.full_epochs),
            "samples_per_s": rate, "speedup": speedup,
            "efficiency": speedup / run.processes if speedup else None,
            "baseline": ref.name if ref else None,
            "comm_ms_per_step": 1000 * comm / steps if has_comm and steps else None,
            "compute_ms_per_step": 1000 * compute / steps if has_comm and steps else None,
            "epochs_at_budget": epochs_within(run, budget_s),
            "train_time_s": run.summary.get("aggregates", {}).get("train_time_s"),
            "best_val_loss": run.summary.get("aggregates", {}).get("best_val_loss"),
            "test_loss": test.get("loss"), "test_accuracy": test.get("accuracy"),
            "gpu_util": _mean(r.get("gpu_util") for r in run.epochs),
            "gpu_mem_mb": max((r["gpu_mem_mb"] for r in run.epochs if r.get("gpu_mem_mb") is not None), default=None),
        }
        rows.append(row)
    rows.sort(key=lambda r: (r["batch_per_process"] or 0, r["processes"], r["point"]))
    return rows


def _fmt(key: str, value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, float):
        if key == "lr":
            return f"{value:.3g}"
        if key in ("speedup", "efficiency", "epochs_at_budget"):
            return f"{value:.2f}"
        if key == "test_accuracy":
            return f"{100 * value:.2f}%"
        if key in ("best_val_loss", "test_loss"):
            return f"{value:.4f}"
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return str(value)


def columns_for(rows: list[dict]) -> list[tuple[str, str]]:
    swept = list(dict.fromkeys(k for r in rows for k in r if k.startswith("swept:")))
    cols = COLUMNS[:2] + [(k, k.split(".")[-1]) for k in swept] + COLUMNS[2:]
    if any(r.get("gpu_util") is not None for r in rows):
        cols += GPU_COLUMNS
    return cols


def markdown_table(rows: list[dict]) -> str:
    cols = columns_for(rows)
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(k, row.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row.get(k) for k in keys})
