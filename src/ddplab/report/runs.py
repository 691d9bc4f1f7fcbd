"""Finished run folders as reports see them: metrics.json (and, for study points, study_point.json), read through
RunFiles. Nothing else."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ddplab.engine.run_folder.folder import RunFiles
from ddplab.errors import UserError

# Sections that name or present a run but do not change what it computes.
_NOT_THE_EXPERIMENT = ("experiment", "logging", "checkpoint", "generate")


@dataclass
class Run:
    """A finished run folder: its metrics.json (`summary`) and, for a study point, its study_point.json (`point`)."""

    path: Path
    summary: dict
    point: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The grid point (shared by its repeats), or the folder of a run outside a study.
        self.name: str = self.point.get("point") or self.path.name
        self.run_name: str = self.point.get("run") or self.path.name
        self.repeat = int(self.point.get("repeat", 1))
        self.ddp: dict = self.summary.get("ddp", {})
        self.processes = int(self.ddp.get("world_size", 1))
        self.nodes = int(self.point.get("nodes", 1))
        self.setup: str = self.point.get("setup") or f"{self.nodes}x{self.processes // self.nodes}"
        self.swept: dict = self.point.get("swept", {})
        self.epochs: list[dict] = self.summary.get("epochs", [])
        self.full_epochs = [r for r in self.epochs if not r.get("partial")]
        self.steps: list[dict] = self.summary.get("steps", [])
        self.total_steps = int(
            self.summary.get("aggregates", {}).get("steps") or (self.epochs[-1]["step"] if self.epochs else 0)
        )
        # Setup and swept values: what a reader tells points apart by.
        self.label = " ".join([self.setup, *(f"{k.split('.')[-1]}={v}" for k, v in self.swept.items())])

    def experiment_key(self) -> str:
        """The config without naming and presentation: runs with equal keys differ only in processes."""
        config = {k: v for k, v in self.summary.get("config", {}).items() if k not in _NOT_THE_EXPERIMENT}
        return json.dumps(config, sort_keys=True)


def find_runs(dirs: Sequence[str | Path], command: str = "report") -> tuple[list[Run], list[Path]]:
    """Finished runs under the given folders, and the unfinished ones passed over; errors name `command`."""
    runs, unfinished, seen = [], [], set()
    for d in dirs:
        root = Path(d)
        if not root.exists():
            raise UserError(f"{command}: no such folder: {d}")
        for found in RunFiles.under(root):
            if found.path.resolve() in seen:
                continue
            seen.add(found.path.resolve())
            summary = found.summary() or {}
            if summary.get("status") != "complete":
                unfinished.append(found.path)
                continue
            runs.append(Run(found.path, summary, found.point()))
    if not runs:
        where = ", ".join(str(d) for d in dirs)
        raise UserError(f"{command}: no finished run folders (metrics.json with status complete) under {where}")
    return runs, unfinished
