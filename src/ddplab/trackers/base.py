"""What every tracker is, and the one ddplab had first: TensorBoard event files in the run folder."""

from __future__ import annotations

import math

from ddplab.engine.run_folder.files import subfolder
from ddplab.engine.run_folder.folder import RunFolder

LOG_ROW_SKIP = ("step", "epoch", "elapsed_s")  # a log row's bookkeeping, not a training metric


def numbers(row: dict, skip=()) -> dict:
    return {
        k: float(v)
        for k, v in row.items()
        if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class Tracker:
    name = ""
    remembers = False  # keeps what it holds in trackers.json (a tracker that cannot be asked)

    def start(self, view, record: dict, study: dict | None) -> tuple[int, int]:
        """Start or continue this run's tracker run; returns the last (train, epoch-row) steps it holds."""
        raise NotImplementedError

    def log(self, values: dict, step: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """After a snapshot: what it was sent so far is kept even if the process dies now."""

    def finish(self, view, status: str) -> None:
        """The run ended (complete), stopped to be continued (preempted; interrupted: Ctrl-C) or raised (failed)."""


class TensorBoard(Tracker):
    """Event files in the run folder's tensorboard/; a resumed run purges the events after its snapshot."""

    name = "tensorboard"

    def start(self, view, record, study):
        from torch.utils.tensorboard import SummaryWriter  # about a second to import: at the first scalar

        folder = subfolder(view.run.path, RunFolder.TENSORBOARD)  # never a link to elsewhere
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=view.step + 1)
        return view.step, view.step

    def log(self, values, step):
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def flush(self):
        self.writer.flush()

    def finish(self, view, status):
        self.writer.close()
