"""`ddplab report DIR...`: report.md, report.csv and PNG plots from run folders."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ddplab.engine.run_folder.files import write_atomic
from ddplab.report import plots, table
from ddplab.report.noise import comparisons, efficiency_notes
from ddplab.report.runs import find_runs
from ddplab.report.scaling_table import scaling_tables


def make_report(dirs: list[str | Path], out_dir: str | Path, budget_s: float | None = None) -> Path:
    """Write the report into `out_dir`; returns the path of report.md."""
    runs, unfinished = find_runs(dirs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    budget, budget_from = table.study_budget(runs, budget_s)
    rows = table.build_rows(runs, budget)
    table.write_csv(rows, out / "report.csv")

    images = [
        *plots.setups_plots(rows, out),
        *plots.sweep_plots(rows, out),
        plots.val_epoch_plot(runs, out / "val_epochs.png"),
        *plots.loss_plots(runs, out),
        plots.accuracy_plot(runs, out / "accuracy_time.png"),
        plots.comm_plot(rows, out / "comm.png"),
    ]

    repeats = sorted({r["repeats"] for r in rows})
    try:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = None
    lines = [
        f"# Scaling report: {', '.join(str(d) for d in dirs)}",
        "",
        f"{len(runs)} finished runs, {len(rows)} points"
        + (f", {'/'.join(map(str, repeats))} repeats each" if repeats != [1] else ", one run each")
        + f"; written {time.strftime('%Y-%m-%d %H:%M:%S')}"
        + (f"; load average now {load}" if load else "")
        + ".",
        "",
        "## Timing",
        "",
        table.markdown_table(rows),
        "",
        "- Cells read **median (min–max)** over a point's repeats (same config and seed); one value when they agree "
        "or the point ran once.",
        "- **speedup** = training samples/s of the run ÷ median samples/s of the 1-process point of the same "
        "experiment (same config apart from the setup, hence the same per-process batch); "
        "**efficiency** = speedup ÷ processes (1.00 is linear scaling). Measured from throughput, not epoch time.",
        "- **mean epoch time** is training time per full epoch, evaluation excluded; "
        "**samples/s** is its mean over epochs.",
        "- **comm ms/step**: wall time per optimizer step during which at least one gradient all-reduce "
        "(with any simulated network delay) was in flight, mean over ranks; **compute ms/step**: the rest of the step.",
        (
            "- **epochs @ budget**: epochs trained (fractional, from the step log) within "
            f"{budget:.1f} s of training time ({budget_from}); ≈ marks a run that trained less than that, "
            "projected as budget ÷ mean epoch time."
            if budget
            else f"- **epochs @ budget**: — ({budget_from})."
        ),
        "- lr is the learning rate actually used, after `training.lr_scaling`.",
    ]
    if table.has_replicas(rows):  # a report without replica groups reads as it always did
        lines.append(
            "- **global batch** of a replica-group run (`distributed.fault_tolerance=replicas`, one run folder per "
            "group): the samples its committed steps actually trained on, mean per step over its epochs "
            "(metrics.csv's `global_batch`), of the batch planned with every group present; **replica groups**: "
            "the fewest groups in an epoch's steps (metrics.csv's `replicas`), lowest–highest over the epochs, "
            "of the groups planned. The step-by-step record is each group's replicas.csv."
        )
    if any(r["speedup"] is None for r in rows):
        lines.append("- speedup is blank where no 1-process point of the same experiment is among these runs.")
    if baselines := {r["baseline"] for r in rows if r["baseline"]}:
        lines.append(f"- baselines: {', '.join(sorted(baselines))}.")
    if unfinished:
        lines.append(f"- left out (not finished): {', '.join(str(p) for p in unfinished)}.")
    if any(r["strategy"] != "ddp" for r in rows):  # a DDP-only report reads as it always did
        lines += [
            "",
            "## Memory and cost per strategy",
            "",
            table.strategy_table(rows),
            "",
            "- **params / grads / optimizer MiB / rank**: what one process holds (ddp: everything; fsdp: 1/N of it; "
            "hsdp: 1/(processes per node)). **peak MiB**: the largest rank's peak, CUDA's max_memory_allocated "
            "on GPU, the process's peak resident size on CPU (libraries and data included).",
            "- **step ms**: mean epoch time ÷ steps per epoch. **comm ms/step**: the time per step during which "
            "a collective was in flight, hidden by compute or not: DDP's gradient all-reduce; FSDP's parameter "
            "all-gathers and gradient reduce-scatters (hsdp: and the all-reduce across nodes). "
            "**overhead ms/step**: the step's time beyond the same experiment's 1-process point, communication "
            "not hidden by compute (and any slowdown of processes sharing a machine), for every strategy.",
        ]
    quality = table.quality_columns_for(rows)
    if any(table.is_quality(k) for k, _ in quality):
        lines += [
            "",
            "## Quality",
            "",
            table.markdown(rows, quality),
            "",
            "- the task's own scores (accuracy and macro precision / recall / F1 for classification; R², MAE, "
            "RMSE for regression; a Task's torchmetrics by their names): val scores are the last epoch's, on "
            "the whole validation split; test scores are the best model's on the test split.",
        ]
    if notes := comparisons(rows) + efficiency_notes(rows):
        lines += [
            "",
            "## Differences and noise",
            "",
            "Throughput (samples/s) of points that differ in one thing only; where their ranges over repeats "
            "overlap the difference is within noise and no order is claimed.",
            "",
        ]
        lines += [f"- {line}" for line in notes]
    if scaling := scaling_tables(rows, budget, budget_from):
        lines += ["", "## Scaling (one column per setup)", "", *scaling]
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in images if p is not None]
    write_atomic(out, "report.md", "\n".join(lines) + "\n")
    return out / "report.md"
