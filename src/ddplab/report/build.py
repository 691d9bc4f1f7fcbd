"""`ddplab report DIR...`: report.md, report.csv and PNG plots from run folders."""

from __future__ import annotations

import time
from pathlib import Path

from ddplab.report import plots
from ddplab.report.runs import find_runs
from ddplab.report.table import build_rows, default_budget, markdown_table, write_csv


def make_report(dirs: list[str | Path], out_dir: str | Path, budget_s: float | None = None) -> Path:
    """Write the report into `out_dir`; returns the path of report.md."""
    runs, unfinished = find_runs(dirs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    budget_from = "given" if budget_s is not None else "the shortest training time among these runs"
    budget = budget_s if budget_s is not None else default_budget(runs)
    rows = build_rows(runs, budget)
    write_csv(rows, out / "report.csv")

    images = [plots.epoch_time_plot(rows, runs, out / "epoch_time.png"),
              plots.scaling_plot(rows, runs, out / "scaling.png"),
              *plots.loss_plots(runs, out),
              plots.accuracy_plot(runs, out / "accuracy_time.png"),
              plots.comm_plot(rows, out / "comm.png")]
    images = [p for p in images if p is not None]

    lines = [f"# Scaling report: {', '.join(str(d) for d in dirs)}", "",
             f"{len(runs)} finished runs; written {time.strftime('%Y-%m-%d %H:%M:%S')}.", "",
             markdown_table(rows), "",
             "- **speedup** = training samples/s of the run ÷ samples/s of the 1-process run of the same "
             "experiment (same config apart from the process count, hence the same per-process batch); "
             "**efficiency** = speedup ÷ processes (1.00 is linear scaling). Measured from throughput, not epoch time.",
             "- **mean epoch time** is training time per full epoch, evaluation excluded; **samples/s** is its mean over epochs.",
             "- **comm ms/step**: wall time per optimizer step during which at least one gradient all-reduce "
             "(with any simulated network delay) was in flight, mean over ranks; **compute ms/step**: the rest of the step.",
             f"- **epochs @ budget**: epochs trained (fractional, from the step log) within {budget:.1f} s of "
             f"training time ({budget_from}).",
             "- lr is the learning rate actually used, after `training.lr_scaling`."]
    baselines = {r["baseline"] for r in rows if r["baseline"]}
    if any(r["speedup"] is None for r in rows):
        lines.append("- speedup is blank where no 1-process run of the same experiment is among these runs.")
    if baselines:
        lines.append(f"- baselines: {', '.join(sorted(baselines))}.")
    if unfinished:
        lines.append(f"- left out (not finished): {', '.join(str(p) for p in unfinished)}.")
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in images]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out / "report.md"
