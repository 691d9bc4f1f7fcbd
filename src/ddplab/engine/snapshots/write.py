"""Snapshots written and restored; this module alone writes them.

The run's state is a set of named stateful parts (`Parts`, registered in loop/parts.py), each of a kind: SHARED
(rank 0's state in state.pt, loaded on every rank), PER_RANK (every rank's, gathered into state.pt; at another world
size the part stays as built, which load() says) or SHARDED (fsdp|hsdp's model and optimizer: every rank writes
shards/ with torch.distributed.checkpoint, which reshards them on load to any world size).

A snapshot (`step-000000123/`, or `best/`: the best validation loss, its weights whole) is built under `.tmp-<name>`
and renamed into place once the `COMPLETE` marker (manifest.py) is written after an fsync of the data, so a kill at
any moment leaves the previous complete snapshot untouched. With checkpoint.async_save the shards are written in the
background and rank 0 writes checksums and marker in a thread of its own, once DCP's save has ended on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
import torch.distributed as dist

from ddplab.engine.run_folder.files import subfolder, write_atomic
from ddplab.engine.snapshots.manifest import CHECKSUM, FORMAT, MARKER, Damaged, describe, seal, step_snapshots
from ddplab.engine.snapshots.read import BEST, SHARDS, STATE, load_shards, open_snapshot, read_state, same_model, shapes
from ddplab.errors import RunError, UserError, first_line, no_space, write_failed

SHARED, PER_RANK, SHARDED = "shared", "per_rank", "sharded"


def part(state_dict: Callable[[], Any], load_state_dict: Callable[[Any], object] = lambda state: None):
    """A stateful part made of two functions (without the second: a value saved, never loaded back)."""
    return SimpleNamespace(state_dict=state_dict, load_state_dict=load_state_dict)


class Parts:
    """The named stateful parts a snapshot holds, each of a kind (SHARED, PER_RANK, SHARDED)."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.kinds: dict[str, str] = {}

    def add(self, name: str, obj, kind: str = SHARED) -> None:
        if name in self.objects:
            raise UserError(f"two stateful parts are named {name!r}; a snapshot holds each part under its own name")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UserError(f"stateful part {name!r}: {type(obj).__name__} has no state_dict() and load_state_dict()")
        self.objects[name], self.kinds[name] = obj, kind

    def files(self) -> dict:  # for the manifest
        return {name: SHARDS if kind == SHARDED else STATE for name, kind in self.kinds.items()}

    def of(self, kind: str) -> dict:
        """The state_dict() of each part of `kind`, by name."""
        return {name: obj.state_dict() for name, obj in self.objects.items() if self.kinds[name] == kind}

    def states(self, ctx) -> tuple[dict, dict]:
        """(what state.pt holds, what the shards hold). A collective: every rank's per-rank states are
        gathered (state.pt holds them as a list in rank order)."""
        plain, own = self.of(SHARED), self.of(PER_RANK)
        if own:
            ranks = ctx.gather_objects(own)
            plain.update({name: [states[name] for states in ranks] for name in own})
        return plain, self.of(SHARDED)

    def load(self, plain: dict, folder: Path, ctx, world_size: int) -> list[str]:
        """Every part from a snapshot's state.pt (`plain`) and shards, written by `world_size` processes.
        Returns the parts left as built: absent from the snapshot, or per-rank at another world size."""
        sharded = self.of(SHARDED)  # DCP loads into these
        if sharded:
            if "model" in sharded:
                same_model(folder, sharded["model"], shapes(folder / SHARDS))
            load_shards(sharded, folder / SHARDS, ctx.is_distributed)
        left = []
        for name, obj in self.objects.items():
            kind = self.kinds[name]
            if kind == SHARDED:
                obj.load_state_dict(sharded[name])
            elif name not in plain or (kind == PER_RANK and world_size != ctx.world_size):
                left.append(name)
            else:
                obj.load_state_dict(plain[name][ctx.rank] if kind == PER_RANK else plain[name])
        return left


def _dcp_error() -> tuple:
    """DCP's CheckpointException (a BaseException, which a failed sharded save raises) once DCP is imported, else
    nothing. torch.distributed.checkpoint brings FSDP and DTensor with it, about a second of every process's start,
    so only runs with sharded parts import it; until one has, nothing can raise its exception."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return (api.CheckpointException,) if api is not None else ()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(folder: Path, manifest: dict) -> None:
    """The COMPLETE marker, its content the manifest, written last, once the snapshot's data is on disk."""
    write_atomic(folder, MARKER, json.dumps(seal(manifest)), sync=True)


def _remove(path: Path) -> None:
    """A leftover folder gone; a link in its place is removed as a link, never followed."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


class Checkpointer:
    """The snapshots under `root` (a run's checkpoints/): written, listed, checked, loaded and pruned."""

    def __init__(self, root: Path, is_main: bool, keep_last: int = 2, checksums: bool = True) -> None:
        self.root = Path(root)
        self.is_main = is_main
        self.keep_last = keep_last
        self.checksums = checksums
        # A background save: DCP's future, the finisher thread, the error it met, DCP's own process group.
        self._pending: Future | None = None
        self._saving: Future | None = None
        self._finisher: threading.Thread | None = None
        self._error: RunError | None = None
        self._group: dist.ProcessGroup | None = None

    def latest(self) -> Path | None:
        return next(reversed(step_snapshots(self.root)), None)

    def clean_incomplete(self) -> list[str]:
        """Remove what a kill during a save left behind; returns the names removed."""
        if not self.is_main or not self.root.is_dir():
            return []
        removed = []
        for p in sorted(self.root.iterdir()):
            unmarked = (p.name.startswith("step-") or p.name == BEST) and not (p / MARKER).is_file()
            if p.is_dir() and (p.name.startswith((".tmp-", ".old-")) or unmarked):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
        return removed

    def save(self, parts: Parts, ctx, name: str, info: dict, background: bool = False) -> Path | None:
        """A collective: the snapshot `name` of `parts`, its manifest made of `info` (step, epoch,
        consumed, world_size, global_batch, config) and its files. Rank 0 writes state.pt, every rank
        its shards (in the background: staged now, written while training goes on); rank 0 then
        checksums every file and writes the marker last. Returns the folder (rank 0; None elsewhere)."""
        if SHARDED in parts.kinds.values():
            self.wait()  # one background save at a time: the previous one is complete first
        plain, sharded = parts.states(ctx)
        tmp, final = self.root / f".tmp-{name}", self.root / name
        manifest = {"format": FORMAT, **info, "parts": parts.files()}
        try:
            if self.is_main:
                self.root.parent.mkdir(parents=True, exist_ok=True)
                subfolder(self.root.parent, self.root.name)  # a link where checkpoints/ belongs is refused
                _remove(tmp)
                tmp.mkdir()
            known: dict = {}
            if sharded:
                ctx.barrier()  # the folder exists before any rank writes into it
                self._save_shards(sharded, tmp / SHARDS, ctx, background)
                if not background and ctx.is_distributed:
                    # Each rank describes the shard files it wrote, all at once: rank 0 alone would read
                    # every rank's in turn while training waits.
                    mine = sorted((tmp / SHARDS).glob(f"__{ctx.rank}_*.distcp"))
                    for theirs in ctx.gather_objects(describe(tmp, self.checksums, files=mine)):
                        known.update(theirs)
            if self.is_main:
                write_atomic(tmp, STATE, lambda f: torch.save(plain, f), sync=True)
                if not (sharded and background):
                    self._finish(tmp, final, manifest, known)
        except (Exception, *_dcp_error()) as exc:  # noqa: BLE001 - disk full, permissions: one line naming the path
            raise self._failed(name, exc) from exc
        if self.is_main and sharded and background:
            self._saving = self._pending
            self._finisher = threading.Thread(
                target=self._finish_when_saved, daemon=True, args=(self._pending, tmp, final, manifest)
            )
            self._finisher.start()
        return final if self.is_main else None

    def _save_shards(self, shards: dict, folder: Path, ctx, background: bool) -> None:
        import torch.distributed.checkpoint as dcp  # sharded parts only: see _dcp_error

        if background:
            if ctx.is_distributed and self._group is None:
                # DCP's own collectives run in a background thread: a group of their own keeps them apart from
                # training's.
                group = dist.new_group(backend="gloo")
                assert isinstance(group, dist.ProcessGroup)  # every rank is a member
                self._group = group
            saved = dcp.async_save(
                shards, checkpoint_id=str(folder), process_group=self._group, no_dist=not ctx.is_distributed
            )
            # A newer torch returns an AsyncSaveResponse, whose upload future is the one to wait for.
            self._pending = cast(Future, getattr(saved, "upload_completion", saved))
        else:
            with warnings.catch_warnings():  # one process: "assuming the intent is to save in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(shards, checkpoint_id=str(folder), no_dist=not ctx.is_distributed)

    def _finish_when_saved(self, saved, tmp: Path, final: Path, manifest: dict) -> None:
        """The finisher thread of a background save: checksums and marker off the training thread."""
        try:
            saved.result()
            self._finish(tmp, final, manifest)
        except (Exception, *_dcp_error()) as exc:  # noqa: BLE001 - raised by wait(), in the training thread
            self._error = self._failed(final.name, exc)

    def _finish(self, tmp: Path, final: Path, manifest: dict, known: dict | None = None) -> None:
        """Checksums (but of the files `known` describes), the marker, the rename into place, then old
        step snapshots pruned."""
        if (tmp / SHARDS).is_dir():
            _fsync_dir(tmp / SHARDS)
        files = describe(tmp, self.checksums, known)
        write_marker(tmp, {**manifest, "checksum": CHECKSUM if self.checksums else None, "files": files})
        if final.exists():  # the same name saved again: the best model, or a step snapshot that ends an epoch
            old = self.root / f".old-{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        for old in step_snapshots(self.root)[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def newest(self, log=print) -> tuple[Path, dict, dict] | None:
        """(folder, manifest, what state.pt holds) of the newest step snapshot that passes its checks;
        each one skipped gets one line."""
        for folder in reversed(step_snapshots(self.root)):
            try:
                return (folder, *open_snapshot(folder))
            except Damaged as err:
                log(f"skipping snapshot {folder.name}: {err}")
        return None

    def wait(self) -> None:
        """The background save, if any, complete (its marker written on rank 0)."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                pending.result()
        except (Exception, *_dcp_error()) as exc:  # noqa: BLE001 - DCP's own is a BaseException
            self._error = self._error or self._failed("", exc)
        if self._finisher is not None:
            self._finisher.join()
            self._finisher = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def settle(self, grace_s: float = 2.0) -> None:
        """On the way out of a failed run: a background save whose shards are all written still gets
        its checksums and marker. The finisher is a daemon thread, so the process would end it half-way;
        a save still waiting on a rank that died is given `grace_s`, then left incomplete."""
        finisher, saved = self._finisher, self._saving
        if finisher is None or saved is None or not finisher.is_alive():
            return
        if not futures.wait([saved], timeout=grace_s).not_done:
            finisher.join()

    def _failed(self, name: str, exc: BaseException) -> RunError:
        if isinstance(exc, _dcp_error()) and exc.failures:  # DCP's gathered failures: the first rank's
            exc = next(iter(exc.failures.values()))[0]
        if self.is_main and name:
            _remove(self.root / f".tmp-{name}")  # a full disk: its room back, so the run can record why it failed
        previous = self.latest()
        kept = f"the previous complete snapshot {'(' + str(previous) + ') ' if previous else ''}is kept"
        if no_space(exc, self.root):  # "no space left on device writing <file> (<free> free)"
            return RunError(f"{write_failed(getattr(exc, 'filename', None) or self.root / name, exc)}; {kept}")
        return RunError(
            f"cannot write snapshot {self.root / name} ({type(exc).__name__}: {first_line(exc, 160)}); {kept}"
        )

    def restore(self, parts: Parts, ctx, log, named: Path | None = None) -> tuple[Path, dict, list[str]] | None:
        """A collective: the snapshot `named`, else the newest that passes its checks (rank 0 checks,
        the others follow), loaded into `parts`. (folder, manifest, parts left as built), or None."""
        found = error = None
        named = named.parent if named is not None and named.is_file() else named  # a snapshot's state.pt: its folder
        if self.is_main:
            try:
                found = (named, *open_snapshot(named)) if named else self.newest(log)
            except Damaged as err:  # the snapshot named is untrusted: every rank stops
                error = f"checkpoint.resume: {err}"
        error, chosen = ctx.broadcast_object((error, found and (str(found[0]), found[1])))
        if error:
            raise UserError(error)
        if chosen is None:
            return None
        folder, manifest = Path(chosen[0]), chosen[1]
        plain = found[2] if found is not None else read_state(folder / STATE)  # found: rank 0's choice, read
        return folder, manifest, parts.load(plain, folder, ctx, manifest["world_size"])
