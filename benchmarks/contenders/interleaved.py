"""ddplab and the hand-written loop in one process, epoch by epoch.

    torchrun --standalone --nproc-per-node=N benchmarks/contenders/interleaved.py gpt 3 out.json

ddplab trains as in ddplab_run.py (through `ddplab.commands.run.train`, as `ddplab train` does), and a
callback runs one epoch of `handwritten.HandLoop` after each of ddplab's epochs (with
--alternate: before ddplab's odd epochs, after its even ones, so neither loop always goes
first), on its own model copy, optimizer, DDP wrapper and loader. Each pair of epochs runs
within seconds of each other in the same processes, so what slows a whole run down (the host,
where its memory landed) slows both. What ddplab sets for the whole process (kept host memory,
a frozen start-up heap) applies to the hand-written loop too, so this measures the loops, not
the process settings.

ddplab's clock counts what its callbacks do (epoch_time_s is every second between two rows but
evaluations and snapshots), so a hand-written epoch run from a hook lands in one of ddplab's rows:
the same epoch's when it runs at the epoch's start, the next one's when it runs after the row. The
epoch times reported for ddplab are the rows' less the hand-written epochs inside them, and its
tokens/s and MFU are the rows' over those times.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import contender_args  # noqa: E402
from ddplab_run import train_and_report  # noqa: E402
from handwritten import HandLoop  # noqa: E402

import ddplab  # noqa: E402


class HandEpochs(ddplab.Callback):
    """One hand-written epoch beside each of ddplab's, outside its timing: after its validation,
    or (odd epochs, with --alternate) before its first step."""

    def __init__(self, args) -> None:
        self.args, self.loop, self.times = args, None, []
        self.ddplab: list[float] = []  # each of ddplab's rows' epoch_time_s, less the hand-written epochs in it
        self.rates: dict[str, list] = {"tokens_per_s": [], "mfu": []}  # the rows' own, over those times
        self.inside = 0.0  # seconds of hand-written epochs that the row to come counts

    def on_train_start(self, view) -> None:
        self.loop = HandLoop(self.args)  # the process group exists now: its DDP wrapper can sync

    def first(self, view) -> bool:
        return self.args.alternate and view.epoch % 2 == 1

    def hand_epoch(self) -> None:
        start = time.perf_counter()
        self.times.append(self.loop.epoch(len(self.times)))
        self.inside += time.perf_counter() - start

    def on_epoch_start(self, view) -> None:
        if self.first(view):
            self.hand_epoch()

    def on_epoch_end(self, view, row) -> None:
        self.ddplab.append(row["epoch_time_s"] - self.inside)
        for name, rates in self.rates.items():
            rates.append(row[name] * row["epoch_time_s"] / self.ddplab[-1] if row.get(name) else row.get(name))
        self.inside = 0.0
        if not row.get("partial") and not self.first(view):
            self.hand_epoch()

    def on_train_end(self, view, summary) -> None:
        self.loop.close()


def main() -> None:
    args = contender_args()
    hand = HandEpochs(args)
    # ddplab's epoch times and rates without the hand-written epochs, in place of its rows' own
    train_and_report(
        args, callbacks=[hand], extra=lambda: {"epoch_times": hand.ddplab, **hand.rates, "hand_epoch_times": hand.times}
    )


if __name__ == "__main__":
    main()
