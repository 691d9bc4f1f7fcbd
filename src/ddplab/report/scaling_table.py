"""The scaling table: one column per setup, one row per quantity, efficiency against the smallest setup of the
same experiment; written when the points span more than one setup."""

from __future__ import annotations

from collections import defaultdict

from ddplab.report.plots import setup_order
from ddplab.report.table import cell, fmt, quality_keys, score_header

ROWS = [
    ("lr", "Learning rate"),
    ("global_batch", "Global batch size"),
    ("steps_per_epoch", "Steps per epoch"),
    ("mean_epoch_time_s", "Avg epoch time (s)"),
    ("epochs_at_budget", "Epochs @ budget"),
    ("scaling_efficiency", "Scaling efficiency"),
    ("best_val_loss", "Best validation loss"),
    ("test_loss", "Test loss"),
    ("test_accuracy", "Top-1 test accuracy"),
]


def _score_rows(items: list[dict]) -> list[tuple[str, str]]:
    """The task's other test scores that some point holds (R², MAE, RMSE for regression; a Task's own)."""
    keys = [k for k in quality_keys(items) if k.startswith("test_") and k not in dict(ROWS)]
    return [(k, "T" + score_header(k)[1:]) for k in keys if any(r.get(k) is not None for r in items)]


def _with_efficiency(items: list[dict]) -> list[dict]:
    """Efficiency against the smallest setup: (rate / its rate) / (processes / its processes)."""
    order = setup_order(items)
    items = sorted((dict(r) for r in items), key=lambda r: order.index(r["setup"]))
    small = items[0]
    for row in items:
        if row.get("samples_per_s") and small.get("samples_per_s"):
            ratio = row["processes"] / small["processes"]
            for suffix in ("", "_min", "_max"):
                value = row.get(f"samples_per_s{suffix}")
                row[f"scaling_efficiency{suffix}"] = value / small["samples_per_s"] / ratio if value else None
    return items


def scaling_tables(rows: list[dict], budget_s: float | None, budget_why: str) -> list[str]:
    """Markdown lines: a titled table per experiment that was run on two setups or more."""
    experiments: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        experiments[row["_experiment"]].append(row)
    lines: list[str] = []
    for items in experiments.values():
        if len({r["setup"] for r in items}) < 2:
            continue
        items = _with_efficiency(items)
        others = [f"{k.split('.')[-1]}={v}" for k, v in items[0].items() if k.startswith("swept:")]
        title = "Scaling table" + (f" ({', '.join(others)})" if others else "")
        budget = (
            f"epochs @ budget: within {fmt('budget', budget_s)} s of training time"
            if budget_s
            else f"epochs @ budget: — ({budget_why})"
        )
        lines += [
            f"### {title}",
            "",
            "| | " + " | ".join(f"{r['setup']}" for r in items) + " |",
            "|---|" + "|".join("---" for _ in items) + "|",
        ]
        for key, name in ROWS + _score_rows(items):
            lines.append(f"| **{name}** | " + " | ".join(cell(r, key) for r in items) + " |")
        lines += [
            "",
            f"Columns are setups (nodes x processes per node); efficiency is throughput against "
            f"{items[0]['setup']} per process; {budget}"
            + (
                "; ≈ marks a projection (budget ÷ avg epoch time) for a run that trained less than the budget"
                if any(r.get("epochs_at_budget_projected") for r in items)
                else ""
            )
            + ".",
            "",
        ]
    return lines
