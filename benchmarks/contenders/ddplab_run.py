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
from ddplab.registry import load_config  # noqa: E402
from ddplab.run import train  # noqa: E402


def train_and_report(args, callbacks=(), extra=dict) -> None:
    """Train through ddplab's entry and write the result file; `extra()` adds fields to it."""
    # Beside the result file: one folder for every rank (they share the run folder and token cache).
    runs = Path(args.out).resolve().parent / "ddplab-runs"
    cfg = load_config(None, overrides(args) + [f"experiment.output_dir={runs}", "experiment.name=b"])
    summary = train(cfg, callbacks=callbacks)
    rows = summary["epochs"] if summary else []
    report(args.out, [r["epoch_time_s"] for r in rows],
           {"data_wait_s": [r.get("data_wait_s") for r in rows],
            "tokens_per_s": [r.get("tokens_per_s") for r in rows], "mfu": [r.get("mfu") for r in rows], **extra()})


class RealClock(Callback):
    """A continuous clock beside metrics.csv's: from each epoch's start to its last log interval (where the
    loop has synced with the device), over the same steps epoch_time_s covers."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_epoch_start(self, view):
        self.started = time.perf_counter()

    def on_log(self, view, values):
        if view.activity == "train" and view.phase == "train":
            self.last_log = time.perf_counter()

    def on_epoch_end(self, view, row):
        self.times.append(self.last_log - self.started)


def main() -> None:
    clock = RealClock()
    train_and_report(contender_args(), [clock], lambda: {"real_epoch_times": clock.times})


if __name__ == "__main__":
    main()
