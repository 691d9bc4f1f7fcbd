"""What inference needs of a run's data, saved into the run folder when training starts, so that
`ddplab predict` builds its preprocessing from the run folder alone, with the training data gone:

    inference/assets.json   {"meta": Data.meta, "task": Task.describe(), "example": the form of one
                            training item (where its target sits, the target's type and shape, the
                            inputs' dtype), "files": {name: its path below inference/}}
    inference/<name>/...    each file or folder that Data.assets named, copied

Rank 0 writes it at the run's first start, assets.json last (a start cut short mid-copy is redone
by the next); a resume finds assets.json and leaves the folder as it is. Every file goes through
engine/files.py's writers, never through a symbolic link. `predict` takes meta and task from the
checkpoint (the weights' own); assets.json holds them too, for a reader of the folder.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from itertools import islice
from pathlib import Path

import numpy as np
import torch

from ddplab.data.stream import is_stream
from ddplab.engine.files import read_json, write_atomic
from ddplab.engine.run_folder import RunFolder
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
    index = {
        "meta": data.meta,
        "task": data.task.describe(),
        "example": example(first_item(data.train), data.task),
        "files": files,
    }
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
    files from its run folder's inference/ (a snapshot lies two levels below the run folder)."""
    start = found if found.is_dir() else found.parent
    folder = next(
        (p / RunFolder.INFERENCE for p in (start, *start.parents)[:3] if (p / RunFolder.INFERENCE / INDEX).is_file()),
        None,
    )
    saved = read_json(folder / INDEX) if folder else {}
    return Assets(meta=meta, task=task, folder=folder, files=saved.get("files", {})), saved.get("example", {})
