"""Snapshots that survive crashes, and the best model.

A snapshot is a folder `step-000000123/` holding `state.pt`; it counts only once its
marker file `COMPLETE` (written last, after an fsync of the data) is there. Sharded runs
(distributed.strategy=fsdp|hsdp) write the model and optimizer with torch.distributed.checkpoint
into `shards/` (every rank its own file, resharded on load to any world size) and the rest to
`state.pt`; with checkpoint.async_save the shards are written in the background and rank 0 marks
the snapshot complete when DCP's save has finished on every rank. It is built
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
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ddplab.errors import UserError, first_line
from ddplab.engine.run_folder import RunFolder

MARKER = RunFolder.MARKER
STATE = "state.pt"
SHARDS = "shards"
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


def load_file(path: str | Path, weights: bool = True) -> dict:
    """Load a checkpoint safely; a truncated, foreign or code-carrying file is a UserError. A sharded
    snapshot's weights are gathered whole in this process, or (weights=False) only their shapes given."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"checkpoint not found: {path}") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not ours"
        raise UserError(f"cannot load checkpoint {path}: {_why(str(exc))}") from None
    if isinstance(obj, dict) and obj.get("sharded"):
        obj["model"] = (consolidated if weights else shapes)(Path(path).parent / SHARDS)
    if not isinstance(obj, dict) or "model" not in obj:
        raise UserError(f"cannot load checkpoint {path}: not a ddplab checkpoint (no model weights)")
    return obj


def _tensors(folder: Path, prefix: str = "model.") -> dict:
    """DCP's metadata: stored name (without prefix) -> its tensor's metadata, for `prefix` entries."""
    try:
        found = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - a missing or foreign folder: say which
        raise UserError(f"cannot read sharded checkpoint {folder}: {first_line(exc, 160)}") from None
    return {k[len(prefix):]: m for k, m in found.items() if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}


def shapes(folder: Path) -> dict:
    """A sharded snapshot's parameters as meta tensors: names and shapes, nothing read."""
    return {k: torch.empty(m.size, dtype=m.properties.dtype, device="meta") for k, m in _tensors(folder).items()}


def consolidated(folder: Path) -> dict:
    """A sharded snapshot's model, every parameter whole, read in this one process."""
    state = {"model": {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in _tensors(folder).items()}}
    load_shards(state, folder, distributed=False)
    return state["model"]


def load_shards(state: dict, folder: Path, distributed: bool) -> None:
    """DCP's load into `state` (its tensors, sharded or whole, say what each rank reads)."""
    with warnings.catch_warnings():  # one process: "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(folder), no_dist=not distributed)


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
        self._pending = self._finisher = self._error = self._group = None  # a background save (save_sharded)

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
        tmp = self._begin(step)
        try:
            _write_synced(tmp / STATE, lambda f: torch.save(state, f))
        except OSError as exc:
            raise self._failed(step, exc) from None
        return self._finish(tmp, step, info)

    def save_sharded(self, shards: dict, rest: dict, step: int, info: dict, ctx, background: bool = False) -> Path:
        """A collective: every rank writes its shards (in the background: staged now, written while
        training goes on); rank 0 writes the rest and, once DCP's save ended on every rank, the marker."""
        self.wait()  # one background save at a time: the previous one is complete first
        tmp = self._begin(step) if self.is_main else self.root / f".tmp-step-{step:09d}"
        ctx.barrier()
        try:
            if background:
                if ctx.is_distributed and self._group is None:
                    # DCP's own collectives run in a background thread: a group of their own keeps them
                    # apart from training's.
                    self._group = dist.new_group(backend="gloo")
                saved = dcp.async_save(shards, checkpoint_id=str(tmp / SHARDS), process_group=self._group,
                                       no_dist=not ctx.is_distributed)
                self._pending = getattr(saved, "upload_completion", saved)
            else:
                with warnings.catch_warnings():  # one process: "assuming the intent is to save in a single process"
                    warnings.simplefilter("ignore", UserWarning)
                    dcp.save(shards, checkpoint_id=str(tmp / SHARDS), no_dist=not ctx.is_distributed)
            if self.is_main and not background:
                self._finish(tmp, step, info, rest)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - disk full, permissions: one line naming the path
            raise self._failed(step, exc) from None
        if self.is_main and background:
            self._finisher = threading.Thread(target=self._finish_when_saved, daemon=True,
                                              args=(self._pending, tmp, step, info, rest))
            self._finisher.start()
        return self.root / f"step-{step:09d}"

    def _finish_when_saved(self, saved, tmp: Path, step: int, info: dict, rest: dict) -> None:
        try:
            saved.result()
            self._finish(tmp, step, info, rest)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - raised by wait(), in the training thread
            self._error = self._failed(step, exc)

    def wait(self) -> None:
        """The background save, if any, complete (its marker written on rank 0)."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                pending.result()
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's own is a BaseException
            self._error = self._error or self._failed(-1, exc)
        if self._finisher is not None:
            self._finisher.join()
            self._finisher = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _failed(self, step: int, exc: BaseException) -> UserError:
        if isinstance(exc, CheckpointException) and exc.failures:  # DCP's gathered failures: the first rank's
            exc = next(iter(exc.failures.values()))[0]
        previous = self.latest()
        return UserError(f"cannot write snapshot {self.root / (f'step-{step:09d}' if step >= 0 else '')} "
                         f"({type(exc).__name__}: {first_line(exc, 160)}); the previous complete snapshot "
                         f"{'(' + str(previous) + ') ' if previous else ''}is kept")

    def _begin(self, step: int) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-step-{step:09d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def _finish(self, tmp: Path, step: int, info: dict, rest: dict | None = None) -> Path:
        """The rest of a sharded snapshot (plain values: its own copy), the marker, the rename into place,
        then old snapshots pruned."""
        final = self.root / f"step-{step:09d}"
        if rest is not None:
            _write_synced(tmp / STATE, lambda f: torch.save({**rest, "sharded": True}, f))
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

    def load_snapshot(self, path: Path, weights: bool = True) -> dict:
        path = Path(path)
        if path.is_dir():
            if not (path / MARKER).is_file():
                raise UserError(f"snapshot {path} is incomplete (no {MARKER} marker)")
            path = path / STATE
        return load_file(path, weights)

    def load_latest(self, log=print, weights: bool = True) -> tuple[Path, dict] | None:
        """The newest complete snapshot that loads, falling back to older ones."""
        for snap in reversed(self.snapshots()):
            try:
                return snap, self.load_snapshot(snap, weights)
            except UserError as err:
                log(f"skipping snapshot {snap.name}: {err}")
        return None

    def save_best(self, weights: dict, cfg, data, epoch: int, step: int, **extra) -> None:
        """best.pt, what `generate` / `predict` need (weights, config, task, tokenizer or labels), renamed
        over the previous one."""
        if not self.is_main:
            return
        payload = {"model": weights, "config": cfg.to_dict(),
                   "meta": data.meta, "task": data.task.describe(), "epoch": epoch, "step": step, **extra}
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{BEST}.tmp"
        _write_synced(tmp, lambda f: torch.save(payload, f))
        os.replace(tmp, self.root / BEST)
        _fsync_dir(self.root)
