"""The run folder: rank 0 writes it, other ranks never touch shared files.

config.yaml, env.json, metrics.csv (one row per epoch), metrics.json, train.log,
tensorboard/ and trackers.json (ddplab.trackers), checkpoints/ (SPEC section 4), inference/
(engine/run_folder/assets.py). RunFolder writes them; RunFiles reads them for everyone else (reports read only these
files).
"""

from __future__ import annotations

import csv
import io
import json
import math
import sys
import time
from pathlib import Path

from ddplab.engine.run_folder.files import open_append, read_json, write_atomic
from ddplab.errors import printable, write_failed

EPOCH_COLUMNS = """
    epoch step train_loss val_loss val_accuracy val_top5_accuracy val_precision val_recall val_f1
    val_perplexity val_mae val_rmse val_r2 epoch_time_s eval_time_s snapshot_time_s elapsed_s samples_per_s
    tokens_per_s lr peak_mem_mb mfu gpu_util gpu_mem_mb comm_time_s compute_time_s data_wait_s
""".split()


def _clean(value):
    """JSON has no NaN or infinity; write null for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class RunFolder:
    """Owns the layout: every file name of a run folder is spelt here and nowhere else."""

    CONFIG = "config.yaml"
    ENV = "env.json"
    METRICS_CSV = "metrics.csv"
    METRICS_JSON = "metrics.json"
    LOG = "train.log"
    TENSORBOARD = "tensorboard"
    CHECKPOINTS = "checkpoints"
    SAMPLE = "sample.txt"
    TRACKERS = "trackers.json"  # the MLflow / W&B run each tracker continues (ddplab.trackers)
    POINT = "study_point.json"  # a study point's place in the grid (ddplab.commands.study writes it)
    HEARTBEAT = "heartbeat.json"  # every rank's last heartbeat and the ETA, for `ddplab status`
    LOGS = "logs"  # rank<N>.log: a failed rank's traceback and every thread's stack
    REPLICAS = "replicas.csv"  # replica groups: a row a step taken or dropped, its quorum and its global batch
    INFERENCE = "inference"  # what predict needs of the data: assets.json and Data.assets' files (assets.py)

    def __init__(self, path: Path, is_main: bool) -> None:
        from rich.console import Console  # only rank 0 prints

        self.path = Path(path)
        self.is_main = is_main
        self.console = Console(stderr=False, highlight=False, soft_wrap=True)
        if is_main:
            self.path.mkdir(parents=True, exist_ok=True)
            self._log = open_append(self.path, self.LOG)

    def log(self, message: str, echo: bool = True) -> None:
        if not self.is_main:
            return
        message = printable(message, keep="\n\t")  # a line may quote users' text: no escape reaches a terminal
        if echo:
            self.console.print(message, markup=False)
        self._log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")

    def write_text(self, name: str, text: str) -> None:
        if self.is_main:
            try:
                write_atomic(self.path, name, text)
            except OSError as exc:  # a full disk: one line naming the file, exit 1
                raise write_failed(self.path / name, exc) from exc

    def write_json(self, name: str, obj, default=None) -> None:
        """`default`: what json.dumps makes of a value it cannot write (None: refuse it)."""
        self.write_text(name, json.dumps(_clean(obj), indent=2, default=default) + "\n")

    def write_epochs(self, rows: list[dict]) -> None:
        """Rewrite metrics.csv from the full history (so a resumed run never duplicates rows)."""
        if not self.is_main:
            return
        extra = sorted({k for r in rows for k in r} - set(EPOCH_COLUMNS))
        columns = [c for c in EPOCH_COLUMNS if any(c in r for r in rows)] + extra
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: ("" if r.get(k) is None else r.get(k)) for k in columns} for r in rows)
        self.write_text(self.METRICS_CSV, out.getvalue())

    def close(self) -> None:
        if not self.is_main:
            return
        self._log.close()
        sys.stdout.flush()


def amend(path: Path, line: str, **fields) -> None:
    """From a process that does not hold the run folder open (the launcher, a rank reporting for a dead rank 0,
    the teardown after the process group): `fields` merged into metrics.json, then `line` appended to train.log.
    metrics.json first: a train.log that cannot be written (a link planted there) leaves the status told."""
    path = Path(path)
    merged = {**read_json(path / RunFolder.METRICS_JSON), **fields}
    try:
        write_atomic(path, RunFolder.METRICS_JSON, json.dumps(_clean(merged), indent=2) + "\n")
    except OSError as exc:  # a full disk: one line naming the file
        raise write_failed(path / RunFolder.METRICS_JSON, exc) from exc
    run = RunFolder(path, is_main=True)
    try:
        run.log(line, echo=False)
    finally:
        run.close()


class RunFiles:
    """A run folder as any process reads it, written or being written: `ddplab status`, reports, studies, verify,
    workloads. Every reading of its files goes through here; nothing is written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def around(cls, path: str | Path) -> RunFiles | None:
        """The run folder `path` lies in (a folder holding metrics.json: the path's own, or one above it)."""
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        return next((cls(p) for p in (folder, *folder.resolve().parents) if cls(p).exists()), None)

    @classmethod
    def under(cls, root: str | Path) -> list[RunFiles]:
        """`root` when it is a run folder, else every run folder below it (snapshot folders excepted), once each."""
        if cls(root).exists():
            return [cls(root)]
        found = {m.parent.resolve(): m.parent for m in sorted(Path(root).rglob(RunFolder.METRICS_JSON))}
        return [cls(folder) for folder in found.values() if RunFolder.CHECKPOINTS not in folder.parts]

    def exists(self) -> bool:
        return (self.path / RunFolder.METRICS_JSON).is_file()

    def summary(self) -> dict | None:
        """metrics.json; None when it is missing or holds no JSON object (not yet written, or not ddplab's)."""
        summary = read_json(self.path / RunFolder.METRICS_JSON)
        return summary if isinstance(summary, dict) and summary else None

    def finished(self) -> bool:
        """A run that ended by itself; a crashed ("running") or pre-empted one is continued instead."""
        return (self.summary() or {}).get("status") == "complete"

    def point(self) -> dict:
        """A study point's place in its study's grid ({} for a run outside a study)."""
        return read_json(self.path / RunFolder.POINT)

    def heartbeat(self) -> dict:
        """Every rank's last heartbeat and the ETA ({} before the first)."""
        return read_json(self.path / RunFolder.HEARTBEAT)

    def quorum_steps(self) -> list[dict]:
        """replicas.csv's rows of steps taken (replica groups: how many groups made each one)."""
        try:
            with (self.path / RunFolder.REPLICAS).open() as f:
                return [row for row in csv.DictReader(f) if row.get("time")]
        except OSError:
            return []
