"""Snapshots and checkpoint files read back (for resume, predict, generate, export and verify): checked against
their manifest first, loaded with `torch.load(weights_only=True)` (nothing is unpickled unsafely), a sharded
snapshot's model gathered whole in one process, or (weights=False) read as its parameters' shapes only.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import torch

from ddplab.engine.snapshots.manifest import MARKER, Damaged, step_snapshots, verify
from ddplab.errors import UserError, first_line

STATE = "state.pt"
SHARDS = "shards"
BEST = "best"


def open_snapshot(folder: Path) -> tuple[dict, dict]:
    """(manifest, what state.pt holds) of a snapshot whose files match its manifest; Damaged otherwise."""
    manifest = verify(folder)
    state = read_state(folder / STATE)
    progress = state.get("trainer")
    if isinstance(progress, dict) and progress.get("step", manifest["step"]) != manifest["step"]:
        raise Damaged(f"{folder / STATE}: holds step {progress['step']}, the manifest says step {manifest['step']}")
    return manifest, state


def _contents(folder: Path, weights: bool = True) -> dict:
    """What a checked snapshot holds, with its manifest's config."""
    manifest, state = open_snapshot(folder)
    return _whole(folder, {**state, "config": manifest.get("config")}, weights)


def _whole(folder: Path, state: dict, weights: bool) -> dict:
    """The model's weights gathered whole from the shards in this process, or (weights=False) only their shapes."""
    shards = folder / SHARDS
    if "model" not in state and shards.is_dir():
        whole = {"model": shapes(shards, "cpu" if weights else "meta")}
        if weights:
            load_shards(whole, shards, distributed=False)
        state["model"] = whole["model"]
    return state


def read_state(path: Path) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise Damaged(f"{path}: missing") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "not ours"
        raise Damaged(f"{path}: {_why(str(exc))}") from None
    if not isinstance(state, dict):
        raise Damaged(f"{path}: not a ddplab checkpoint")
    return state


def load_file(path: str | Path, weights: bool = True) -> dict:
    """A checkpoint file loaded safely, not checked against a manifest (load_checkpoint does that); a
    truncated, foreign or code-carrying file is a UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}")
    try:
        state = _whole(path.parent, read_state(path), weights)
    except Damaged as err:
        raise UserError(f"cannot load checkpoint {err}") from None
    if "model" not in state:
        raise UserError(f"cannot load checkpoint {path}: not a ddplab checkpoint (no model weights)")
    return state


def load_snapshot(path: str | Path, weights: bool = True) -> dict:
    """What a snapshot folder (or its state.pt) holds, checked first, the model's weights whole
    (weights=False, sharded: their shapes only); a file of its own, not a snapshot's, loaded as it is."""
    path = Path(path)
    if path.is_file() and not (path.parent / MARKER).is_file():
        return load_file(path, weights)  # nothing to check it against
    try:
        return _contents(path if path.is_dir() else path.parent, weights)
    except Damaged as err:
        raise UserError(str(err)) from None


def _warn(message: str) -> None:
    print(f"ddplab: {message}", file=sys.stderr, flush=True)


def load_checkpoint(path: str | Path, log=_warn) -> tuple[Path, dict]:
    """(where, what it holds: model weights whole, config, meta, task) for predict, generate and export,
    from a checkpoint file, a snapshot folder, or a run folder: its best model, else its newest snapshot.
    A snapshot is checked against its manifest first; in a run folder one that fails is skipped with
    one line, and the next is tried."""
    p = Path(path)
    if p.is_file() or (p / MARKER).is_file():  # a file (a snapshot's state.pt, a user's) or a snapshot
        return p.parent if p.is_file() and (p.parent / MARKER).is_file() else p, load_snapshot(p)
    if not p.is_dir():
        raise UserError(f"no such run folder or checkpoint: {path}")
    for root in (p / "checkpoints", p):
        candidates = [root / BEST] * (root / BEST / MARKER).is_file() + step_snapshots(root)[::-1]
        for folder in candidates:
            try:
                return folder, _contents(folder)
            except Damaged as err:
                log(f"skipping snapshot {folder.name}: {err}")
        if candidates:
            raise UserError(f"no snapshot in {root} passes its checks (each is named above)")
    raise UserError(f"no checkpoint in {path} (expected checkpoints/{BEST}/ or a complete snapshot)")


def _tensors(folder: Path, prefix: str = "model.") -> dict:
    """DCP's metadata: stored name (without prefix) -> its tensor's metadata, for `prefix` entries."""
    import torch.distributed.checkpoint as dcp  # sharded only: it brings FSDP, a second of start-up
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        found = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - a missing or foreign folder: say which
        raise UserError(f"cannot read sharded checkpoint {folder}: {first_line(exc, 160)}") from None
    return {
        k[len(prefix) :]: m for k, m in found.items() if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }


def shapes(folder: Path, device: str = "meta") -> dict:
    """A sharded snapshot's parameters as empty tensors (on the meta device: names and shapes, nothing read)."""
    return {k: torch.empty(m.size, dtype=m.properties.dtype, device=device) for k, m in _tensors(folder).items()}


def load_shards(state: dict, folder: Path, distributed: bool) -> None:
    """DCP's load into `state` (its tensors, sharded or whole, say what each rank reads)."""
    import torch.distributed.checkpoint as dcp  # sharded only: it brings FSDP, a second of start-up

    with warnings.catch_warnings():  # one process: "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(folder), no_dist=not distributed)


def same_model(path, mine: dict, theirs: dict, where: str = "") -> None:
    """The snapshot at `path` holds this model: the same parameter names and shapes (the first that
    differs is named)."""
    missing = [k for k in mine if k not in theirs]
    extra = [k for k in theirs if k not in mine]
    if missing or extra:
        name = (missing or extra)[0]
        raise UserError(
            f"{where}{path} holds another model ({'no' if missing else 'an unknown'} "
            f"parameter {name}); resume with the config it was trained with"
        )
    for k, v in mine.items():
        if tuple(v.shape) != tuple(theirs[k].shape):
            raise UserError(
                f"{where}{path} holds another model ({k} is {tuple(theirs[k].shape)}, "
                f"this config builds {tuple(v.shape)}); resume with the config it was trained with"
            )


def _why(message: str) -> str:
    """torch.load's long explanations, as a few words."""
    unsafe = re.search(r"GLOBAL ([\w.]+)", message)
    if unsafe:
        return (
            f"it holds Python objects ({unsafe.group(1)}) that could run code when loaded; refused (weights_only=True)"
        )
    if "central directory" in message or "zip archive" in message or "eof" in message.lower():
        return "the file is truncated or not a torch checkpoint"
    return "not a torch checkpoint"
