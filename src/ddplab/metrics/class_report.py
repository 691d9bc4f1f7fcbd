"""Per-class scores and the global confusion matrix (the evaluator's own, all-reduced once across ranks):
confusion_matrix_<split>.csv and .png in the run folder, and a dict for metrics.json."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np

from ddplab.callbacks import Callback
from ddplab.engine.run_folder.files import write_atomic
from ddplab.evaluators import per_class_scores


def class_reports(evaluators: dict, folder: Path, names: list[str] | None, write: bool, plots: bool = True) -> dict:
    """{split: {"classes", "per_class", "confusion_matrix"}}; files only where `write`, PNGs only with `plots`."""
    out = {}
    for split, evaluator in evaluators.items():
        confusion = getattr(evaluator, "global_confusion", None)
        if confusion is None:
            continue
        n = confusion.shape[0]
        classes = list(names) if names and len(names) == n else [str(i) for i in range(n)]
        matrix = [[int(x) for x in row] for row in confusion.tolist()]
        scores = per_class_scores(confusion)
        out[split] = {
            "classes": classes,
            "per_class": {
                c: {k: scores[k][i] for k in ("precision", "recall", "f1", "support")} for i, c in enumerate(classes)
            },
            "confusion_matrix": matrix,
        }
        if write:
            table = io.StringIO(newline="")
            csv.writer(table).writerows(
                [["true \\ predicted", *classes], *([c, *r] for c, r in zip(classes, matrix, strict=True))]
            )
            write_atomic(folder, f"confusion_matrix_{split}.csv", table.getvalue())
            if plots:
                confusion_png(folder / f"confusion_matrix_{split}.png", classes, matrix, split)
    return out


def subplots(*grid: int, figsize: tuple[float, float], **kw):
    """(figure, axes) of a new figure; no pyplot: a third of the import time, and no global state to close."""
    from matplotlib.figure import Figure  # the report extra; imported only to draw

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*grid, **kw)


def save_png(fig, path: Path) -> Path:
    fig.tight_layout()
    write_atomic(path.parent, path.name, lambda f: fig.savefig(f, format="png", dpi=110))
    return path


def confusion_png(path: Path, classes: list[str], matrix: list[list[int]], split: str) -> None:
    counts = np.asarray(matrix, dtype=float)
    rows = counts.sum(1, keepdims=True)
    share = np.divide(counts, rows, out=np.zeros_like(counts), where=rows > 0)  # recall per true class
    n = len(classes)
    side = min(12.0, 3.0 + 0.45 * n)
    fig, ax = subplots(figsize=(side + 1, side))
    image = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    if n <= 30:  # counts stay readable up to about 30 classes
        for i, j in np.ndindex(n, n):
            shade = "white" if share[i, j] > 0.5 else "black"
            ax.text(j, i, f"{int(counts[i, j])}", ha="center", va="center", fontsize=7, color=shade)
    ax.set_xticks(range(n), classes, rotation=90 if n > 10 else 0, fontsize=7)
    ax.set_yticks(range(n), classes, fontsize=7)
    ax.set(xlabel="predicted", ylabel="true", title=f"Confusion matrix, {split} ({int(counts.sum())} samples)")
    fig.colorbar(image, ax=ax, label="share of the true class")
    save_png(fig, path)


class ClassReports(Callback):
    """At the end, each split's last confusion matrix (val: the final model; test: the best one)."""

    def __init__(self) -> None:
        self.evaluators: dict = {}

    def on_eval_end(self, view, split, metrics) -> None:
        if getattr(view.evaluator, "global_confusion", None) is not None:
            self.evaluators[split] = view.evaluator

    def on_train_end(self, view, summary) -> None:
        if self.evaluators:
            names = getattr(view.data.task, "class_names", None) or view.data.meta.get("label_names")
            summary["classes"] = class_reports(
                self.evaluators, view.run.path, names, view.is_main, view.config.logging.plots
            )
            view.run.write_json(view.run.METRICS_JSON, summary)
