"""Rows of the report: one per run, then one per point (repeats folded into medians with their min and max).
Speedup is throughput over the median of the same experiment's 1-process point; efficiency = speedup / processes.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections import defaultdict
from pathlib import Path

from ddplab.engine.run_folder.files import write_atomic
from ddplab.report.runs import Run

# Measured values that vary run to run: a point with repeats gets their median, min and max.
TIMING = (
    "epochs mean_epoch_time_s samples_per_s speedup efficiency comm_ms_per_step compute_ms_per_step rank_spread "
    "epochs_at_budget train_time_s gpu_util gpu_mem_mb step_ms overhead_ms_per_step peak_mem_mb"
).split()
# The task's own scores, as its evaluator names them (a user Task's torchmetrics by their keys in
# Task.metrics()): these first, in this order, then any others by name.
SCORES = ("loss", "accuracy", "top5_accuracy", "precision", "recall", "f1", "perplexity", "r2", "mae", "rmse")
SCORE_HEADERS = {"f1": "F1", "r2": "R²", "mae": "MAE", "rmse": "RMSE"}

# (key, markdown header); the CSV uses the keys.
HEAD = [("point", "point"), ("setup", "setup (nodes x procs)")]
TIMING_COLUMNS = [
    ("processes", "processes"),
    ("batch_per_process", "batch / process"),
    ("global_batch", "global batch"),
    ("lr", "lr"),
    ("steps_per_epoch", "steps / epoch"),
    ("epochs", "epochs"),
    ("repeats", "repeats"),
    ("mean_epoch_time_s", "mean epoch time (s)"),
    ("samples_per_s", "samples/s"),
    ("speedup", "speedup"),
    ("efficiency", "efficiency"),
    ("comm_ms_per_step", "comm ms/step"),
    ("compute_ms_per_step", "compute ms/step"),
    ("rank_spread", "rank spread"),
    ("epochs_at_budget", "epochs @ budget"),
]
# What a strategy (ddp, fsdp, hsdp) holds per rank and what it costs.
STRATEGY_COLUMNS = [
    ("params_mb", "params MiB / rank"),
    ("grads_mb", "grads MiB / rank"),
    ("optim_mb", "optimizer MiB / rank"),
    ("peak_mem_mb", "peak MiB"),
    ("samples_per_s", "samples/s"),
    ("step_ms", "step ms"),
    ("comm_ms_per_step", "comm ms/step"),
    ("overhead_ms_per_step", "overhead ms/step"),
]
GPU_COLUMNS = [("gpu_util", "GPU util %"), ("gpu_mem_mb", "GPU mem (MiB)")]
PERCENT = {"val_accuracy", "test_accuracy", "val_top5_accuracy", "test_top5_accuracy", "rank_spread"}


def _score_order(name: str) -> tuple:
    return SCORES.index(name) if name in SCORES else len(SCORES), name


def is_quality(key: str) -> bool:
    return key == "best_val_loss" or key.startswith(("val_", "test_"))


def quality_keys(rows: list[dict]) -> list[str]:
    """best_val_loss, then every split's scores that some row holds, val before test, in SCORES order."""
    scores = sorted(
        {
            k.split("_", 1)[1]
            for r in rows
            for k in r  # not a point's range
            if k.startswith(("val_", "test_")) and not (k.endswith(("_min", "_max")) and k[:-4] in r)
        },
        key=_score_order,
    )
    return ["best_val_loss", *(f"{split}_{name}" for split in ("val", "test") for name in scores)]


def score_header(key: str) -> str:
    """val_f1 -> 'val F1', best_val_loss -> 'best val loss'."""
    split, name = key.split("_", 1)
    return f"{split} {SCORE_HEADERS.get(name, name.replace('_', ' '))}"


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


def study_budget(runs: list[Run], budget_s: float | None) -> tuple[float | None, str]:
    """The budget for 'epochs @ budget' and where it came from, or None and why (never the shortest run's time:
    a run that finished early would read as fewer epochs)."""
    if budget_s is not None:
        return budget_s, "given with --budget"
    budgets = {r.summary.get("aggregates", {}).get("time_budget_s") for r in runs}
    if len(budgets) == 1 and None not in budgets:
        return budgets.pop(), "the runs' training.time_budget"
    why = (
        "the runs have different training.time_budget values"
        if len(budgets - {None}) > 1
        else "no budget: pass --budget (e.g. --budget 2h) or train with training.time_budget"
    )
    return None, why


def epochs_at_budget(run: Run, budget_s: float) -> tuple[float | None, bool]:
    """(epochs, projected): from the step log when the run trained that long, else budget / mean epoch time."""
    spe = run.ddp.get("steps_per_epoch")
    if not spe:
        return None, False
    agg = run.summary.get("aggregates", {})
    own = agg.get("time_budget_s")
    if run.summary.get("stop_reason") == "time_budget" and own and abs(own - budget_s) <= 0.01 * budget_s:
        return run.total_steps / spe, False
    if (agg.get("train_time_s") or 0) >= budget_s:
        return epochs_within(run, budget_s), False
    epoch_time = _mean(r.get("epoch_time_s") for r in run.full_epochs)
    return (budget_s / epoch_time, True) if epoch_time else (None, False)


def step_ms(run: Run, epoch_s: float | None) -> float | None:
    """Milliseconds per optimizer step: over the full epochs, else over the partial ones (a run cut by max_steps)."""
    if epoch_s and run.ddp.get("steps_per_epoch"):
        return 1000 * epoch_s / run.ddp["steps_per_epoch"]
    partial = sum(r.get("epoch_time_s") or 0.0 for r in run.epochs)
    return 1000 * partial / run.total_steps if partial and run.total_steps else None


def replica_columns(run: Run) -> dict:
    """A replica-group run: the global batch its steps actually made (mean per step over its epochs) beside the
    planned one, and the fewest groups in an epoch's steps, lowest and highest over its epochs; else {}."""
    rows, steps, before = [], [], 0
    for r in run.epochs:
        if "replicas" in r and r.get("global_batch") is not None:
            rows.append(r)
            steps.append(max(r["step"] - before, 1))
        before = r["step"]
    if not rows:
        return {}
    present = [r["replicas"] for r in rows if r.get("replicas") is not None]
    return {
        "global_batch": sum(r["global_batch"] * n for r, n in zip(rows, steps, strict=True)) / sum(steps),
        "global_batch_planned": run.ddp.get("global"),
        "replicas_min": min(present, default=None),
        "replicas_max": max(present, default=None),
        "replica_groups": run.summary.get("config", {}).get("distributed", {}).get("replica_groups"),
    }


def run_rows(runs: list[Run], budget_s: float | None) -> list[dict]:
    rows = []  # one per run (every repeat), before speedup
    for run in runs:
        steps = run.total_steps
        comm = sum(r.get("comm_time_s") or 0.0 for r in run.epochs)
        compute = sum(r.get("compute_time_s") or 0.0 for r in run.epochs)
        strategy = run.ddp.get("strategy") or "ddp"
        # DDP's hook times its all-reduces, FSDP's own comms its gathers and reduce-scatters; a run that timed neither
        # (fsdp before they were timed) has rows of 0, no measurement.
        timed = (run.summary.get("comm") or {}).get("timed")
        has_comm = any(r.get("comm_time_s") is not None for r in run.epochs) and (
            strategy == "ddp" or run.processes == 1 or bool(timed)
        )
        state = run.ddp.get("state_bytes_per_rank") or {}
        epoch_s = _mean(r.get("epoch_time_s") for r in run.full_epochs)
        test = run.summary.get("test") or {}
        last = run.epochs[-1] if run.epochs else {}
        # The scores the run's task reported: its last epoch's val_<name>, its test split's <name>.
        names = {k[4:] for k in last if k.startswith("val_")} | {k for k in test if k != "samples"}
        scores = sorted(names, key=_score_order)
        at_budget, projected = epochs_at_budget(run, budget_s) if budget_s else (None, False)
        rows.append(
            {
                "point": run.name,
                "run": run.run_name,
                "repeat": run.repeat,
                "path": str(run.path),
                "label": run.label,
                "setup": run.setup,
                "processes": run.processes,
                "nodes": run.nodes,
                **{f"swept:{k}": v for k, v in run.swept.items()},
                "batch_per_process": run.ddp.get("per_process"),
                "grad_accum_steps": run.ddp.get("grad_accum_steps"),
                "global_batch": run.ddp.get("global"),
                "lr": run.ddp.get("lr"),
                "lr_scaling": run.ddp.get("lr_scaling"),
                "steps_per_epoch": run.ddp.get("steps_per_epoch"),
                "epochs": len(run.full_epochs),
                "steps": steps,
                "mean_epoch_time_s": epoch_s,
                "step_ms": step_ms(run, epoch_s),
                "samples_per_s": _mean(r.get("samples_per_s") for r in run.full_epochs or run.epochs),
                "comm_ms_per_step": 1000 * comm / steps if has_comm and steps else None,
                "compute_ms_per_step": 1000 * compute / steps if has_comm and steps else None,
                # (slowest - fastest) / median of the ranks' own step time (metrics.stragglers)
                "rank_spread": _mean(r.get("rank_spread") for r in run.full_epochs or run.epochs),
                "epochs_at_budget": at_budget,
                "epochs_at_budget_projected": projected,
                # Parameters, gradients and optimizer state held by one rank: what fsdp / hsdp divide.
                "strategy": strategy,
                **{
                    f"{k}_mb": state[n] / 2**20 if n in state else None
                    for k, n in (("params", "parameters"), ("grads", "gradients"), ("optim", "optimizer"))
                },
                "peak_mem_mb": _spread([r.get("peak_mem_mb") for r in run.epochs])[2],
                "train_time_s": run.summary.get("aggregates", {}).get("train_time_s"),
                "best_val_loss": run.summary.get("aggregates", {}).get("best_val_loss"),
                **{f"val_{k}": last.get(f"val_{k}") for k in scores},
                **{f"test_{k}": test.get(k) for k in scores},
                "gpu_util": _mean(r.get("gpu_util") for r in run.epochs),
                "gpu_mem_mb": _spread([r.get("gpu_mem_mb") for r in run.epochs])[2],
                **replica_columns(run),
                "_group": (run.setup, run.experiment_key()),
                "_experiment": run.experiment_key(),  # repeats share _group
            }
        )
    return rows


def _spread(values: list) -> tuple:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return None, None, None
    return statistics.median(values), min(values), max(values)


def build_rows(runs: list[Run], budget_s: float | None) -> list[dict]:
    """One row per point: medians over its repeats, with `<key>_min` / `<key>_max`."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in run_rows(runs, budget_s):
        groups[row["_group"]].append(row)
    # The baseline of an experiment: its 1-process point (median throughput over repeats).
    base: dict[str, tuple[str, float, float | None]] = {}
    for rows in groups.values():
        first = rows[0]
        rate = _spread([r["samples_per_s"] for r in rows])[0]
        if first["processes"] == 1 and rate and first["_experiment"] not in base:
            base[first["_experiment"]] = (first["point"], rate, _spread([r["step_ms"] for r in rows])[0])
    out = []
    for rows in groups.values():
        ref = base.get(rows[0]["_experiment"])
        for r in rows:
            r["speedup"] = r["samples_per_s"] / ref[1] if ref and r["samples_per_s"] else None
            r["overhead_ms_per_step"] = r["step_ms"] - ref[2] if ref and r["step_ms"] and ref[2] else None
            r["efficiency"] = r["speedup"] / r["processes"] if r["speedup"] else None
        row = {k: v for k, v in rows[0].items() if k not in ("run", "repeat", "path")}
        row["repeats"] = len(rows)
        row["runs"] = " ".join(sorted((r["run"] for r in rows), key=lambda n: (len(n), n)))
        row["baseline"] = ref[0] if ref else None
        # Replica groups: the batch each repeat actually made, and all groups seen.
        made = ["global_batch"] if "global_batch_planned" in row else []
        for key in TIMING + quality_keys(rows) + made:
            row[key], row[f"{key}_min"], row[f"{key}_max"] = _spread([r.get(key) for r in rows])
        row["epochs_at_budget_projected"] = any(r["epochs_at_budget_projected"] for r in rows)
        if made:
            row["replicas_min"] = _spread([r.get("replicas_min") for r in rows])[1]
            row["replicas_max"] = _spread([r.get("replicas_max") for r in rows])[2]
        out.append(row)
    out.sort(key=sort_key)
    return out


def sort_key(row: dict) -> tuple:
    swept = tuple(_number_or_text(v) for k, v in row.items() if k.startswith("swept:"))
    return (row["batch_per_process"] or 0, swept, row["processes"], row["nodes"], row["point"])


def _number_or_text(value) -> tuple:
    try:
        return (0, float(value), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(value))


def fmt(key: str, value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if isinstance(value, float):
        if key == "lr":
            return f"{value:.3g}"
        if key in ("speedup", "efficiency", "scaling_efficiency", "epochs_at_budget"):
            return f"{value:.2f}"
        if key in PERCENT:
            return f"{100 * value:.2f}%"
        if is_quality(key):
            return f"{value:.4f}"
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return str(value)


def cell(row: dict, key: str) -> str:
    """The median, then its range over repeats when they differ."""
    if key == "replicas":  # groups present: `1–2 of 2` (the fewest in an epoch's steps, lowest–highest over epochs)
        lo, hi, of = row.get("replicas_min"), row.get("replicas_max"), row.get("replica_groups")
        if lo is None:
            return "—"
        return (f"{lo}" if lo == hi else f"{lo}–{hi}") + (f" of {of}" if of is not None else "")
    text = fmt(key, row.get(key))
    if key == "epochs_at_budget" and row.get("epochs_at_budget_projected") and row.get(key) is not None:
        text = "≈" + text
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    if row.get("repeats", 1) > 1 and lo is not None and hi is not None and fmt(key, lo) != fmt(key, hi):
        text += f" ({fmt(key, lo)}–{fmt(key, hi)})"
    if key == "global_batch" and row.get("global_batch_planned") is not None:  # replica groups: the batch made
        text += f" of {row['global_batch_planned']}"
    return text


def _swept_columns(rows: list[dict]) -> list[tuple[str, str]]:
    return [(k, k.split(".")[-1]) for k in swept_keys(rows)]


def swept_keys(rows: list[dict]) -> list[str]:
    """The swept config keys of the rows (`swept:<dotted key>`), in the order met."""
    return list(dict.fromkeys(k for r in rows for k in r if k.startswith("swept:")))


def quality_columns_for(rows: list[dict]) -> list[tuple[str, str]]:
    """The task's scores that some row holds. The last epoch's val loss is left out: the best one is there."""
    keys = [k for k in quality_keys(rows) if k != "val_loss" and any(r.get(k) is not None for r in rows)]
    return HEAD + _swept_columns(rows) + [(k, score_header(k)) for k in keys]


def markdown(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(cell(row, k) for k, _ in cols) + " |" for row in rows]
    return "\n".join(lines)


def markdown_table(rows: list[dict]) -> str:
    """The timing table; GPU columns only where a run measured its GPU."""
    gpu = GPU_COLUMNS if any(r.get("gpu_util") is not None for r in rows) else []
    timing = list(TIMING_COLUMNS)
    if has_replicas(rows):  # after the global batch they made
        timing.insert(timing.index(("global_batch", "global batch")) + 1, ("replicas", "replica groups"))
    return markdown(rows, HEAD + _swept_columns(rows) + timing + gpu)


def has_replicas(rows: list[dict]) -> bool:
    """Some row is a replica-group run's (replica_columns)."""
    return any("global_batch_planned" in r for r in rows)


def strategy_table(rows: list[dict]) -> str:
    """Memory per rank and the cost per step of each point, with its strategy (a column of its own unless swept)."""
    mine = [] if "swept:distributed.strategy" in swept_keys(rows) else [("strategy", "strategy")]
    return markdown(rows, HEAD + _swept_columns(rows) + mine + STRATEGY_COLUMNS)


def write_csv(rows: list[dict], path: Path) -> None:
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    f = io.StringIO(newline="")
    writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    writer.writeheader()
    writer.writerows(rows)  # None and absent keys are written as empty cells
    write_atomic(path.parent, path.name, f.getvalue())
