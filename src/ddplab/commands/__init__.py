"""What a user runs. One module per group of `ddplab` commands, imported by ddplab.cli only when asked for: train.py
(a training job's), inference.py (a trained model's), scaling.py (many runs'), env.py. Beside them, what they run:
launch.py (every process ddplab starts), run.py (`ddplab train` in one process of the job), study.py (a study's
points), verify.py, predict.py and trained_model.py. None imports torch at its top: `ddplab status` and the
launcher start without it."""

from __future__ import annotations

import math
from pathlib import Path

from ddplab.engine.run_folder.folder import RunFiles
from ddplab.errors import UserError


def split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] [key=value ...]`: the first item without '=' is the config file."""
    configs = [item for item in items if "=" not in item]
    if len(configs) > 1:
        raise UserError(f"unexpected argument '{configs[1]}': only one config file, then key=value overrides")
    return (configs[0] if configs else None), [item for item in items if "=" in item]


def at_least(name: str, value: float | None, least: float = 1, note: str = "") -> None:
    """A command-line number: None (not given), or finite and at least `least`."""
    if value is not None and not least <= value < math.inf:  # NaN too
        raise UserError(f"{name} must be >= {least}{note} and finite, got {value}")


def output_file(given: str | Path, force: bool, option: str = "--output") -> Path:
    """A file an option names for writing: never a folder or a link; an existing file, or a file
    inside a run folder, only with --force (a typo must not replace a run's config.yaml or metrics)."""
    path = Path(given)
    if path.is_symlink():
        raise UserError(f"{option} {given}: a symbolic link; name the file itself")
    if path.is_dir():
        raise UserError(f"{option} {given}: a folder; name a file")
    if not path.parent.is_dir():
        raise UserError(f"{option} {given}: no such folder: {path.parent}")
    if force:
        return path
    if path.exists():
        raise UserError(f"{option} {given}: the file exists; pass --force to replace it")
    if run := RunFiles.around(path.parent):
        raise UserError(f"{option} {given}: inside the run folder {run.path}; write elsewhere, or pass --force")
    return path


def output_folder(name: str, path: str) -> None:
    """An --output that names a folder to write into: neither it nor a folder above it may be a file."""
    for place in (Path(path), *Path(path).parents):
        if place.exists() and not place.is_dir():
            raise UserError(f"{name}: {place} is a file; give a folder (one is made if missing)")
