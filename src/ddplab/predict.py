"""`ddplab predict`: per input, a label and its probability (classifiers) or the predicted values
(regression), from any trained model.

Each input kind (data.meta["input"]: "text", "image") has an encoder that turns raw inputs into
the model's batch exactly as validation did: the same tokenizer or the same transforms, rebuilt
from what the checkpoint recorded. Other workloads (your own data) read each input as numbers:
`0.5,1.2,3` (one sample's features), or a .npy / .pt file holding one sample's tensor.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

import torch

from ddplab.errors import UserError
from ddplab.inference import load_model
from ddplab.tasks import call_model

# input kind -> "module:function" with signature (meta: dict, items: list[str]) -> inputs batch
ENCODERS: dict[str, str] = {
    "image": "ddplab.data.vision:encode_images",
    "text": "ddplab.data.text_cls:encode_texts",
    "numbers": "ddplab.predict:encode_numbers",
}


def encode_numbers(meta: dict, items: list[str]) -> torch.Tensor:
    rows = []
    for item in items:
        path = Path(item)
        if item.endswith((".npy", ".pt")):
            if not path.is_file():
                raise UserError(f"no such file: {item}")
            try:
                value = (torch.load(path, weights_only=True) if item.endswith(".pt")
                         else torch.from_numpy(__import__("numpy").load(path, allow_pickle=False)))
            except Exception as exc:  # noqa: BLE001 - an unreadable file is the user's to fix
                raise UserError(f"cannot read {item}: {type(exc).__name__}") from None
            rows.append(torch.as_tensor(value, dtype=torch.float32))
            continue
        try:
            rows.append(torch.tensor([float(x) for x in item.split(",")], dtype=torch.float32))
        except ValueError:
            raise UserError(f"input '{item[:40]}' is not comma-separated numbers nor a .npy/.pt file") from None
    shapes = {tuple(r.shape) for r in rows}
    if len(shapes) > 1:
        raise UserError(f"inputs have different shapes: {', '.join(str(s) for s in sorted(shapes))}")
    return torch.stack(rows)


def _encoder(kind: str) -> Callable:
    module, name = ENCODERS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def predict(run: str, items: list[str], batch_size: int = 32, trust_code: bool = False) -> list[tuple]:
    """(input, label, probability) for classifiers; (input, values) for other tasks."""
    model, ckpt, task = load_model(run, trust_code)
    if task.kind == "lm":
        raise UserError(f"{run} holds a language model; use `ddplab generate`")
    meta = ckpt.get("meta", {})
    encode = _encoder(meta.get("input", "numbers"))
    names = getattr(task, "class_names", None) or meta.get("label_names") or \
        [str(i) for i in range(getattr(task, "num_classes", 0) or 0)]
    out = []
    with torch.no_grad():
        for i in range(0, len(items), batch_size):
            chunk = items[i: i + batch_size]
            try:
                output = call_model(model, encode(meta, chunk)).float()
            except RuntimeError as exc:
                first = (str(exc).strip().splitlines() or [""])[0][:120]
                raise UserError(f"the inputs do not fit the model ({first})") from None
            if getattr(task, "num_classes", None):  # built-in or user classifiers: label and probability
                p, idx = torch.softmax(output, dim=-1).max(-1)
                out += [(item, names[int(j)], float(q)) for item, j, q in zip(chunk, idx, p)]
            else:
                out += [(item, [float(v) for v in row.reshape(-1)]) for item, row in zip(chunk, output.reshape(len(chunk), -1))]
    return out
