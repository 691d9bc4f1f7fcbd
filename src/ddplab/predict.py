"""`ddplab predict`: label and probability per input, for any trained classifier.

Each input kind (bundle.meta["input"]: "text", "image") has an encoder that turns raw
inputs into the model's batch exactly as validation did: the same tokenizer or the same
transforms, rebuilt from what the checkpoint recorded.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch

from ddplab.engine.tasks import call_model
from ddplab.errors import UserError
from ddplab.generate import load_model

# input kind -> "module:function" with signature (meta: dict, items: list[str]) -> inputs batch
ENCODERS: dict[str, str] = {
    "image": "ddplab.data.vision:encode_images",
    "text": "ddplab.data.text_cls:encode_texts",
}


def _encoder(kind: str) -> Callable:
    if kind not in ENCODERS:
        raise UserError(f"this checkpoint's inputs ({kind}) cannot be predicted from the command line")
    module, name = ENCODERS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def predict(run: str, items: list[str], batch_size: int = 32) -> list[tuple[str, str, float]]:
    model, ckpt = load_model(run)
    if ckpt.get("task") != "classification":
        raise UserError(f"{run} holds a language model; use `ddplab generate`")
    meta = ckpt.get("meta", {})
    encode = _encoder(meta.get("input", "unknown"))
    names = meta.get("label_names") or [str(i) for i in range(ckpt["num_classes"])]
    out = []
    with torch.no_grad():
        for i in range(0, len(items), batch_size):
            chunk = items[i : i + batch_size]
            probs = torch.softmax(call_model(model, encode(meta, chunk)).float(), dim=-1)
            p, idx = probs.max(-1)
            out += [(item, names[int(j)], float(q)) for item, j, q in zip(chunk, idx, p)]
    return out
