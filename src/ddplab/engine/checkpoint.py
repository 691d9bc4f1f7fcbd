"""Snapshots that survive crashes, and the best model.

A snapshot is a folder `step-000000123/` holding `state.pt`; it counts only once its
marker file `COMPLETE` (written last, after an fsync of the data) is there. It is built
under a temporary name and renamed into place, so a kill at any moment leaves the
previous complete snapshot untouched; incomplete leftovers are ignored and cleaned.
Everything is saved as tensors and plain Python values so it loads with
`torch.load(weights_only=True)`; nothing is unpickled unsafely.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from ddplab.errors import UserError
from ddplab.engine.run_folder import RunFolder

MARKER = "COMPLETE"
STATE = "state.pt"
BEST = "best.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, write) -> None:
    """`write(file)` into a new file whose data is on disk when this returns."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def load_file(path: str | Path) -> dict:
    """Load a checkpoint safely; a truncated, foreign or code-carrying file is a UserError."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"checkpoint not found: {path}") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not ours"
        raise UserError(f"cannot load checkpoint {path}: {_why(str(exc))}") from None
    if not isinstance(obj, dict) or "model" not in obj:
        raise UserError(f"cannot load checkpoint {path}: not a ddplab checkpoint (no model weights)")
    return obj


def _why(message: str) -> str:
    """torch.load's long explanations, as a few words."""
    unsafe = re.search(r"GLOBAL ([\w.]+)", message)
    if unsafe:
        return f"it holds Python objects ({unsafe.group(1)}) that could run code when loaded; refused (weights_only=True)"
    if "central directory" in message or "zip archive" in message or "eof" in message.lower():
        return "the file is truncated or not a torch checkpoint"
    return "not a torch checkpoint"


def write_marker(folder: Path, info: dict) -> None:
    """The COMPLETE marker, written last, once the snapshot's data is on disk."""
    _write_synced(folder / MARKER, lambda f: f.write(json.dumps(info).encode()))


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or a run folder's best model, else its newest complete snapshot."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir():
        raise UserError(f"no such run folder or checkpoint: {path}")
    for candidate in (p / RunFolder.CHECKPOINTS / BEST, p / BEST):
        if candidate.is_file():
            return candidate
    for root in (p / RunFolder.CHECKPOINTS, p):
        latest = Checkpointer(root, is_main=False).latest()
        if latest is not None:
            return latest / STATE
    if (p / MARKER).is_file() and (p / STATE).is_file():  # a snapshot folder itself
        return p / STATE
    raise UserError(f"no checkpoint in {path} (expected {RunFolder.CHECKPOINTS}/{BEST} or a complete snapshot)")


class Checkpointer:
    def __init__(self, root: Path, is_main: bool, keep_last: int = 2) -> None:
        self.root = Path(root)
        self.is_main = is_main
        self.keep_last = keep_last

    def snapshots(self) -> list[Path]:
        """Complete snapshots, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step-*") if p.is_dir() and (p / MARKER).is_file()]
        return sorted(found, key=lambda p: int(p.name.split("-")[1]))

    def latest(self) -> Path | None:
        return (self.snapshots() or [None])[-1]

    def clean_incomplete(self) -> list[str]:
        """Remove what a kill during a save left behind; returns the names removed."""
        if not self.is_main or not self.root.is_dir():
            return []
        removed = []
        for p in sorted(self.root.iterdir()):
            if p.is_dir() and (p.name.startswith((".tmp-", ".old-")) or (p.name.startswith("step-") and not (p / MARKER).is_file())):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
        return removed

    def save_snapshot(self, state: dict, step: int, info: dict) -> Path | None:
        """Rank 0 only writes; the caller holds the other ranks at a barrier."""
        if not self.is_main:
            return None
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{step:09d}"
        tmp = self.root / f".tmp-step-{step:09d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _write_synced(tmp / STATE, lambda f: torch.save(state, f))
        write_marker(tmp, info)
        _fsync_dir(tmp)
        if final.exists():  # the same step saved twice (a step snapshot that ends an epoch)
            old = self.root / f".old-step-{step:09d}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        for old in self.snapshots()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_snapshot(self, path: Path) -> dict:
        path = Path(path)
        if path.is_dir():
            if not (path / MARKER).is_file():
                raise UserError(f"snapshot {path} is incomplete (no {MARKER} marker)")
            path = path / STATE
        return load_file(path)

    def load_latest(self, log=print) -> tuple[Path, dict] | None:
        """The newest complete snapshot that loads, falling back to older ones."""
        for snap in reversed(self.snapshots()):
            try:
                return snap, self.load_snapshot(snap)
            except UserError as err:
                log(f"skipping snapshot {snap.name}: {err}")
        return None

    def save_best(self, model, cfg, data, epoch: int, step: int, **extra) -> None:
        """best.pt, what `generate` / `predict` need (weights, config, task, tokenizer or labels), renamed
        over the previous one."""
        if not self.is_main:
            return
        payload = {"model": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "config": cfg.to_dict(),
                   "meta": data.meta, "task": data.task.describe(), "epoch": epoch, "step": step, **extra}
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{BEST}.tmp"
        _write_synced(tmp, lambda f: torch.save(payload, f))
        os.replace(tmp, self.root / BEST)
        _fsync_dir(self.root)
