"""What inference needs of a run's data, saved into the run folder as training starts, so that `ddplab predict`
builds its preprocessing from the run folder alone:

    inference/assets.json   {"meta": Data.meta, "task": Task.describe(), "example": the form of one training item
                            (never its values), "files": {name: its path below inference/}}
    inference/<name>/...    each file or folder that Data.assets named, copied

Rank 0 writes it at the run's first start, assets.json last (a start cut short mid-copy is redone by the next).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Mapping
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from ddplab.data.stream import is_stream
from ddplab.engine.run_folder.files import write_atomic
from ddplab.engine.run_folder.folder import RunFolder
from ddplab.errors import UserError, write_failed
from ddplab.workload import Assets, Data

INDEX = "assets.json"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def check(data: Data, where: str) -> None:
    """Data.assets: plain names (each becomes a folder name) of files or folders that exist."""
    if not isinstance(data.assets, Mapping):
        raise UserError(f"{where}: Data.assets is a {type(data.assets).__name__}; give a dict: name -> file or folder")
    for name, path in data.assets.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise UserError(f"{where}: Data.assets name {name!r} must be a plain name (letters, digits, _ . -)")
        if not isinstance(path, (str, os.PathLike)) or not Path(path).exists():
            raise UserError(f"{where}: Data.assets[{name!r}] = {path!r} is no file or folder")


def first_item(dataset):
    return next(iter(islice(dataset, 1))) if is_stream(dataset) else dataset[0]


def target_field(task, item: Mapping) -> str | None:
    """The field of a dict item that holds its target: the task's target_field, else `labels`, then `label`."""
    names = (task.target_field,) if task.target_field else ("labels", "label")
    return next((n for n in names if n in item), None)


def example(item, task) -> dict:
    """The form of one item, enough for predict to stand a target beside its inputs (a collate_fn may
    need one) and to read numbers in the inputs' dtype: never the item's values."""
    field = target_field(task, item) if isinstance(item, Mapping) else None
    inputs, target = (None, item.get(field)) if isinstance(item, Mapping) else item
    if isinstance(target, np.ndarray):
        target = torch.as_tensor(target)
    form: dict | int | float
    if isinstance(target, torch.Tensor):
        form = {"dtype": str(target.dtype).removeprefix("torch."), "shape": list(target.shape)}
    else:
        form = type(target)(0) if isinstance(target, (bool, int, float)) else 0
    dtype = str(inputs.dtype).removeprefix("torch.") if isinstance(inputs, torch.Tensor) else None
    return {
        "kind": "dict" if isinstance(item, Mapping) else "pair",
        "field": field,
        "target": form,
        "input_dtype": dtype,
    }


def stand_in(form):
    """A target of the form `example` recorded (zeros: its value is never read)."""
    if isinstance(form, dict):
        return torch.zeros(form["shape"], dtype=getattr(torch, form["dtype"]))
    return form


def save(run: RunFolder, data: Data) -> None:
    """inference/ in the run folder, at the run's first start (rank 0)."""
    if not run.is_main or (run.path / RunFolder.INFERENCE / INDEX).is_file():
        return
    files = {}
    for name, source in data.assets.items():
        source = Path(source)
        if source.is_dir():
            for path in sorted(p for p in source.rglob("*") if p.is_file()):
                _copy(path, run.path, Path(name, path.relative_to(source)))
            files[name] = name
        else:
            files[name] = _copy(source, run.path, Path(name, source.name))
    form = example(first_item(data.train), data.task)
    index = {"meta": data.meta, "task": data.task.describe(), "example": form, "files": files}
    run.write_json(f"{RunFolder.INFERENCE}/{INDEX}", index, default=str)


def _copy(source: Path, run: Path, name: Path) -> str:
    """source -> inference/name in the run folder; `name` as assets.json records it."""
    target = Path(RunFolder.INFERENCE, name)
    try:
        with open(source, "rb") as f:
            write_atomic(run, target, lambda out: shutil.copyfileobj(f, out))
    except OSError as exc:  # a full disk: one line naming the file, exit 1
        raise write_failed(run / target, exc) from exc
    return str(name)


def load(found: Path, meta: dict, task) -> tuple[Assets, dict]:
    """(cfg.assets, the item's example) for the checkpoint at `found`: meta and task from the checkpoint,
    files from its run folder's inference/ (a snapshot lies two levels below the run folder). What
    assets.json says is checked before it is used: each file inside inference/ and reached through no
    link, the example a form this version wrote (a target's dtype a torch dtype, its size bounded)."""
    start = found if found.is_dir() else found.parent
    for folder in (p / RunFolder.INFERENCE for p in (start, *start.parents)[:3]):
        if os.path.lexists(folder / INDEX):
            saved = _index(folder)
            return Assets(meta=meta, task=task, folder=folder, files=saved["files"]), saved["example"]
    return Assets(meta=meta, task=task), {}


# A stand-in target is allocated once per input; its size is bounded before it is (4 TB was asked for).
MAX_TARGET_VALUES = 1 << 26


def _index(folder: Path) -> dict:
    """assets.json as a dict of `files` and `example`, each checked; a UserError naming the entry otherwise."""
    where = folder / INDEX
    for path in (folder, where):
        if path.is_symlink():
            raise UserError(f"{path}: a symbolic link in the run folder's inference/; refused")
    try:
        saved = json.loads(where.read_bytes())
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: cannot be read as JSON ({type(exc).__name__})") from None
    if not isinstance(saved, dict):
        raise UserError(f"{where}: a JSON {_kind(saved)}, not the dict ddplab saved")
    files, form = saved.get("files", {}), saved.get("example", {})
    for key, value in (("files", files), ("example", form)):
        if not isinstance(value, dict):
            raise UserError(f"{where}: {key} is a {_kind(value)}, not a dict")
    inside = folder.resolve()
    for name, rel in files.items():
        _inside(where, folder, inside, name, rel)
    if form:
        _check_example(where, form)
    return {"files": files, "example": form}


def _kind(value) -> str:
    return {"str": "string"}.get(type(value).__name__, type(value).__name__)


def _inside(where: Path, folder: Path, inside: Path, name: str, rel) -> None:
    """files[name] = rel names a file or folder under inference/, reached through no link, holding none."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
        raise UserError(f"{where}: files[{name!r}] = {rel!r:.80} is not a path inside the run folder's inference/")
    path = folder / rel
    links = [p for p in (path, *path.parents) if p.is_relative_to(folder) and p != folder and p.is_symlink()]
    if path.is_dir():
        links += [p for p in path.rglob("*") if p.is_symlink()]
    if links or (path.exists() and not path.resolve().is_relative_to(inside)):
        raise UserError(
            f"{where}: files[{name!r}]: {links[0] if links else path} is a symbolic link, "
            "which could lead outside the run folder; refused"
        )
    if not path.exists():
        raise UserError(f"{where}: files[{name!r}] = {rel!r}: no such file in the run folder's inference/")


def _check_example(where: Path, form: dict) -> None:
    """The example's kind, field, input dtype and target (a number, or a tensor's dtype and shape whose
    size is bounded), all checked before stand_in allocates anything."""

    def refuse(what: str):
        return UserError(f"{where}: example {what}, not a form ddplab saves")

    if form.get("kind", "pair") not in ("dict", "pair"):
        raise refuse(f"kind {form.get('kind')!r:.40}")
    if not isinstance(form.get("field"), (str, type(None))):
        raise refuse(f"field {form.get('field')!r:.40}")
    if form.get("input_dtype") is not None and not _is_dtype(form["input_dtype"]):
        raise refuse(f"input_dtype {form['input_dtype']!r:.40}")
    target = form.get("target", 0)
    if isinstance(target, (bool, int, float)):
        return
    if not isinstance(target, dict):
        raise refuse(f"target {target!r:.40} (a number or a tensor's dtype and shape)")
    if not _is_dtype(target.get("dtype")):
        raise refuse(f"target dtype {target.get('dtype')!r:.40}")
    shape = target.get("shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise refuse(f"target shape {shape!r:.60}")
    if (values := math.prod(shape)) > MAX_TARGET_VALUES:
        raise refuse(f"target shape {shape} ({values:,} values, above {MAX_TARGET_VALUES:,} for one item)")


def _is_dtype(name) -> bool:
    return isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype)
