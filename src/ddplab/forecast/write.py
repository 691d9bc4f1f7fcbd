"""forecast.md, forecast.csv and forecast.png."""

from __future__ import annotations

from pathlib import Path

from ddplab.engine.run_folder.files import write_atomic
from ddplab.metrics.class_report import save_png, subplots
from ddplab.report.table import write_csv

COLUMNS = [
    ("strategy", "strategy", "{}"),
    ("setup", "setup", "{}"),
    ("processes", "processes", "{}"),
    ("global_batch", "global batch", "{}"),
    ("steps_per_epoch", "steps / epoch", "{:,}"),
    ("sent_mb", "sent MB / rank", "{:,.2f}"),
    ("step_ms", "step (ms)", "{:,.2f}"),
    ("compute_ms", "compute (ms)", "{:,.2f}"),
    ("comm_ms", "comm (ms)", "{:,.2f}"),
    ("exposed_comm_ms", "not hidden (ms)", "{:,.2f}"),
    ("epoch_s", "epoch (s)", "{:,.2f}"),
    ("speedup", "speedup", "{:.2f}"),
    ("efficiency", "efficiency", "{:.2f}"),
    ("comm_share", "comm share", "{:.1%}"),
    ("epochs_in_budget", "epochs @ budget", "{:,.1f}"),
]


def markdown(result) -> str:
    # A forecast of DDP alone reads as it always did; strategy and bytes sent come with fsdp or hsdp.
    sharded = any(r["strategy"] != "ddp" for r in result.rows)
    hidden = {"epochs_in_budget"} if not result.budget_s else set()
    cols = [c for c in COLUMNS if c[0] not in hidden | (set() if sharded else {"strategy", "sent_mb"})]
    lines = [f"# Forecast: {result.workload}", ""]
    lines += [f"- {note}" for note in result.notes]
    lines += ["", "| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for row in result.rows:
        lines.append("| " + " | ".join("-" if row.get(k) is None else fmt.format(row[k]) for k, _, fmt in cols) + " |")
    lines += [
        "",
        "Speedup is the 1x1 forecast's epoch time over the setup's, at the same batch per process; "
        "efficiency is speedup / processes; comm (ms) is every collective's time, hidden or not; comm share "
        "is the part not hidden behind compute, over the step; sent MB / rank is what each process sends per "
        "step.",
    ]
    if result.fit is not None:
        lines += [
            "",
            "## The fit: measured vs modelled step time of the multi-process runs",
            "",
            "| run | setup | batch | simulated latency (ms) | simulated bandwidth (Mbit/s) "
            "| measured (ms) | model (ms) | error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for m, predicted in result.fit.points:
            lines.append(
                f"| {m.name} | {m.nodes}x{m.per_node} | {m.batch} | {m.latency_ms:g} | {m.bandwidth_mbps or '-'} | "
                f"{m.step_s * 1e3:,.2f} | {predicted * 1e3:,.2f} | {predicted / m.step_s - 1:+.1%} |"
            )
    return "\n".join(lines) + "\n"


def plot(result, path: Path) -> None:
    rows = result.rows
    several = len({r["strategy"] for r in rows}) > 1
    labels = [f"{r['setup']} {r['strategy']}" if several else r["setup"] for r in rows]
    fig, (left, right) = subplots(1, 2, figsize=(11, 4.2))
    compute = [r["step_ms"] - r["exposed_comm_ms"] for r in rows]
    exposed = [r["exposed_comm_ms"] for r in rows]
    left.bar(labels, compute, label="compute (and hidden communication)", color="#4c72b0")
    left.bar(labels, exposed, bottom=compute, label="communication not hidden", color="#dd8452")
    left.set(xlabel="setup (nodes x processes per node)", ylabel="predicted step time (ms)", title="Step time")
    left.legend(fontsize=8)
    left.tick_params(axis="x", labelrotation=45 if several else 0)
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        ordered = sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["processes"])
        processes, speedups = [r["processes"] for r in ordered], [r["speedup"] for r in ordered]
        right.plot(processes, speedups, "o-", label=f"forecast, {strategy}" if several else "forecast")
        for r, x, y in zip(ordered, processes, speedups, strict=True):
            right.annotate(r["setup"], (x, y), textcoords="offset points", xytext=(4, -10), fontsize=8)
    top = max(r["processes"] for r in rows)
    right.plot([1, top], [1, top], "--", color="grey", label="ideal")
    right.set(xlabel="processes", ylabel="speedup of the epoch over 1x1", title="Speedup")
    right.legend(fontsize=8)
    fig.suptitle(f"Forecast: {result.workload}", fontsize=10)
    save_png(fig, path)


def write_all(result, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out, "forecast.md", markdown(result))
    write_csv([{key: row[key] for key, _, _ in COLUMNS} for row in result.rows], out / "forecast.csv")
    plot(result, out / "forecast.png")
    return out / "forecast.md"
