"""ddplab itself, through its public entry (the same as `ddplab train`).

    torchrun --standalone --nproc-per-node=N benchmarks/contenders/ddplab_run.py gpt 3 out.json [--device cuda]

ddplab picks the device itself (CUDA when present), as `ddplab train` does.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import contender_args, overrides, report  # noqa: E402

from ddplab import Callback  # noqa: E402
from ddplab.commands.run import train  # noqa: E402
from ddplab.registry import load_config  # noqa: E402


def train_and_report(args, callbacks=(), extra=dict) -> None:
    """Train through ddplab's entry and write the result file; `extra()` adds fields to it."""
    # Beside the result file: one folder for every rank (they share the run folder and the data cache).
    runs = Path(args.out).resolve().parent / "ddplab-runs"
    cfg = load_config(None, overrides(args) + [f"experiment.output_dir={runs}", "experiment.name=b"])
    summary = train(cfg, callbacks=callbacks)
    rows = summary["epochs"] if summary else []
    report(
        args.out,
        [r["epoch_time_s"] for r in rows],
        {
            "data_wait_s": [r.get("data_wait_s") for r in rows],
            "tokens_per_s": [r.get("tokens_per_s") for r in rows],
            "mfu": [r.get("mfu") for r in rows],
            **extra(),
        },
    )


class RealClock(Callback):
    """A continuous clock over the span an epoch row claims: from the previous row (or the start of training)
    to this one, less its evaluations and snapshots. An evaluation is timed here, from the hook before it (on
    CUDA the end-of-epoch one follows the log interval's sync) to its on_eval_end; no hook marks a snapshot's
    start, so the row's own snapshot_time_s is taken out. What is left is every step, data wait, log interval
    and callback between the two rows, as epoch_time_s should be."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_start(self, view):
        self.row = self.last = time.perf_counter()
        self.eval = 0.0

    def on_step_end(self, view):
        self.last = time.perf_counter()

    def on_log(self, view, values):
        self.last = time.perf_counter()

    def on_snapshot(self, view, path):
        self.last = time.perf_counter()

    def on_eval_end(self, view, split, metrics):
        now = time.perf_counter()
        self.eval += now - self.last
        self.last = now

    def on_epoch_end(self, view, row):
        now = time.perf_counter()
        self.times.append(now - self.row - self.eval - (row.get("snapshot_time_s") or 0.0))
        self.row = self.last = now
        self.eval = 0.0


def main() -> None:
    clock = RealClock()
    train_and_report(contender_args(), [clock], lambda: {"real_epoch_times": clock.times})


if __name__ == "__main__":
    main()
