"""`ddplab predict`: one row per input, from any trained model (docs/predict.md).

A raw input becomes one sample's model inputs by `Data.preprocess`, else the validation dataset's
torchvision-style `transform` (the input is an image file), else as numbers (`0.5,1.2,3`, a .npy / .pt file).
Samples are batched with the run's collate_fn, pairs with a stand-in target of the training items' form; the
model gets the inputs alone, never a made-up target, through `Task.infer`; `Task.predict` makes the rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from ddplab.commands.trained_model import load_model, read_checkpoint
from ddplab.engine.run_folder import assets
from ddplab.engine.run_folder.files import write_atomic
from ddplab.errors import UserError, first_line
from ddplab.report.table import write_csv
from ddplab.tasks import CONTINUES_TEXT, Task, restore


def _is(item: str, kind: str) -> bool:
    """Whether an input names an existing folder (kind "dir") or file; a text too long for a path, or holding
    what no path holds, names neither."""
    try:
        return Path(item).is_dir() if kind == "dir" else Path(item).is_file()
    except (OSError, ValueError):
        return False


def expand(items: list[str]) -> list[str]:
    """A folder stands for its files (sorted, hidden ones left out); other inputs stay as given."""
    out = []
    for item in items:
        path = Path(item)
        if _is(item, "dir"):
            files = sorted(str(p) for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
            if not files:
                raise UserError(f"the folder {item} holds no files")
            out += files
        else:
            out.append(item)
    return out


def encoder(data, example: dict | None = None) -> Callable[[str], object]:
    """raw input -> one sample's model inputs; `example`: the form of a training item (assets.example)."""
    if data.preprocess is not None:
        return data.preprocess
    example = example or _example(data)
    if example.get("kind") == "dict":
        raise UserError(
            "this run's items are dicts (as Hugging Face's are): predict reads raw inputs through "
            "Data(preprocess=...), a function from one input to one sample's dict, which its data does "
            "not give"
        )
    source = next((d for d in (data.val, data.test, data.train) if d is not None), None)
    for _ in range(16):  # the dataset under Subset-like wrappers (each keeps the one it wraps as `.dataset`)
        if (inner := getattr(source, "dataset", None)) is None or getattr(source, "transform", None) is not None:
            break
        source = inner
    transform = getattr(source, "transform", None)
    if callable(transform):
        return lambda item: transform(_open_image(item, getattr(source, "loader", None)))
    dtype = getattr(torch, example.get("input_dtype") or "float32")
    return lambda item: read_numbers(item).to(dtype)


def _example(data) -> dict:
    """The form of the data's first item (a checkpoint away from its run folder); with no dataset, the
    built-ins' form: (inputs, an integer target)."""
    dataset = next((d for d in (data.val, data.train) if d is not None), None)
    if dataset is None:
        return {"kind": "pair", "target": 0}
    return assets.example(assets.first_item(dataset), data.task)


def _sample(example: dict) -> Callable:
    """One sample's inputs -> what the run's collate_fn gets: a dict as it is; else (inputs, a stand-in target)."""
    if example.get("kind") == "dict":
        return lambda inputs: inputs
    target = assets.stand_in(example.get("target", 0))
    return lambda inputs: (inputs, target)


def _inputs(task, batch, field: str | None):
    """The model's inputs of a collated batch: a mapping without any target field, a pair's inputs."""
    if isinstance(batch, Mapping):
        names = {field, task.target_field, "labels", "label"} - {None}
        return {k: v for k, v in batch.items() if k not in names}
    return task.unpack(batch)[0]


def _open_image(item: str, loader: Callable | None):
    from PIL import Image, UnidentifiedImageError  # the vision extra: only for image inputs

    if not _is(item, "file"):
        raise UserError(f"no such image file: {item[:200]}")
    try:
        if callable(loader):
            return loader(item)
        with Image.open(item) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError):
        raise UserError(f"cannot read {item} as an image") from None


def read_numbers(item: str) -> torch.Tensor:
    """`0.5,1.2,3`, or a .npy / .pt file, as a tensor."""
    if item.endswith((".npy", ".pt")):
        if not _is(item, "file"):
            raise UserError(f"no such file: {item[:200]}")
        try:
            if item.endswith(".pt"):
                return torch.as_tensor(torch.load(item, weights_only=True))
            return torch.from_numpy(np.load(item, allow_pickle=False))
        except Exception as exc:  # noqa: BLE001 - an unreadable file is the user's to fix
            raise UserError(f"cannot read {item}: {type(exc).__name__}") from None
    try:
        return torch.tensor([float(x) for x in item.split(",")])
    except ValueError:
        raise UserError(f"input '{item[:40]}' is not comma-separated numbers nor a .npy/.pt file") from None


def predict(
    run: str, items: list[str], batch_size: int = 32, top_k: int | None = None, trust_code: bool = False
) -> list[dict]:
    """One dict per input: {"input": the input, then what the run's Task.predict gives}."""
    checkpoint = read_checkpoint(run)
    ckpt, _, found = checkpoint
    recorded = restore(ckpt.get("task"))
    if recorded.kind == "lm":  # known from the checkpoint: no need to rebuild the corpus to say so
        raise UserError(CONTINUES_TEXT)
    saved, example = assets.load(found, ckpt.get("meta", {}), recorded)
    model, _, data = load_model(run, trust_code, checkpoint=checkpoint, saved=saved)
    example = example or _example(data)  # a checkpoint away from its run folder: the rebuilt data's
    encode, task = encoder(data, example), data.task
    collate = data.collate_fn or torch.utils.data.default_collate
    sample = _sample(example)
    rows = []
    with torch.no_grad():
        for i in range(0, len(items), batch_size):
            chunk = items[i : i + batch_size]
            samples = [sample(_user(encode, "reading the input", item)) for item in chunk]
            try:
                inputs = _inputs(task, collate(samples), example.get("field"))
            except Exception as exc:  # noqa: BLE001 - inputs of different shapes, mostly
                raise UserError(
                    f"the inputs do not batch together ({type(exc).__name__}: {first_line(exc, 120)})"
                ) from None
            try:
                output = task.infer(model, inputs)
            except (RuntimeError, TypeError, ValueError, IndexError) as exc:
                if example.get("kind") == "dict" and type(task).infer is Task.infer:
                    raise UserError(
                        f"the model does not run on its inputs alone ({type(exc).__name__}: {first_line(exc, 120)}); "
                        f"its training items carried their target '{example.get('field') or 'labels'}', which "
                        f"predict never makes up: give the Task an infer(model, inputs) that runs it as inference "
                        f"needs (a seq2seq model: model.generate(**inputs)) and a predict(output) that reads what "
                        f"it returns (docs/predict.md#a-model-that-generates)"
                    ) from None
                raise UserError(f"the inputs do not fit the model ({first_line(exc, 120)})") from None
            where = f"{type(task).__name__}.predict(output)"
            values = _user(task.predict, where, output) if top_k is None else _user(task.predict, where, output, top_k)
            rows += [{"input": item, **row} for item, row in zip(chunk, values, strict=False)]
    return rows


def _user(fn: Callable, where: str, *args):
    """The workload's own code (preprocess, transform, Task.predict) raising: one line naming it."""
    try:
        return fn(*args)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001
        shown = f" '{args[0][:60]}'" if isinstance(args[0], str) else ""
        raise UserError(f"{where}{shown} raised {type(exc).__name__}: {first_line(exc, 120)}") from None


def _shown(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return ",".join(_shown(v) for v in value)
    return str(value)


def line(row: dict) -> str:
    """What the terminal shows for one input: its values, then the input, tab-separated."""
    return "\t".join([*(_shown(v) for k, v in row.items() if k != "input"), row["input"]])


def output_format(path: str) -> str:
    """ "csv" or "jsonl", from a file's name."""
    kind = Path(path).suffix.lstrip(".")
    if kind not in ("csv", "jsonl"):
        raise UserError(f"--output {path}: name a .csv or a .jsonl file")
    return kind


def write(rows: list[dict], path: str) -> None:
    """Every row with its input, as CSV (lists as comma-separated text) or JSON lines."""
    if output_format(path) == "jsonl":
        write_atomic(Path(path).parent, Path(path).name, "".join(json.dumps(row) + "\n" for row in rows))
    else:
        write_csv(
            [{k: v if isinstance(v, (str, float, int)) else _shown(v) for k, v in r.items()} for r in rows], Path(path)
        )
