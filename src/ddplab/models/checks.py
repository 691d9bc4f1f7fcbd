"""What the launcher checks of a built-in model before any worker starts, from the config alone (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

from ddplab.errors import UserError, first_line

CNN_MIN_SIDE = 6  # two 3x3 convolutions and a 2x2 max-pool leave at least one pixel


def check_image_input(cfg, channels: int, side: int) -> None:
    """Images too small for ddplab's own architectures fail here, not in a worker."""
    name = cfg.model.name
    problem = None
    if name == "cnn" and side < CNN_MIN_SIDE:
        problem = f"the CNN needs images of at least {CNN_MIN_SIDE}x{CNN_MIN_SIDE}"
    elif name == "vit" and side % cfg.model.patch_size:
        problem = f"model.patch_size={cfg.model.patch_size} does not divide it"
    if problem:
        raise UserError(
            f"data.image_size: {side}x{side} images do not fit model.name={name} ({problem}); "
            f"set another data.image_size"
        )


def looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).expanduser().exists() or name.count("/") > 1


def check_hf(cfg) -> None:
    """Cheap, before launch: a local folder must hold a model's config.json (hub names are checked on load)."""
    pretrained = cfg.model.pretrained
    if not pretrained:
        raise UserError(
            "model.name=hf needs model.pretrained=<hub name, e.g. distilbert-base-uncased, or local folder>"
        )
    if not looks_like_path(pretrained):
        return
    p = Path(pretrained).expanduser()
    if not p.is_dir():
        raise UserError(f"model.pretrained: no such model folder: {pretrained}")
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        raise UserError(
            f"model.pretrained: {pretrained} is not a Hugging Face model folder (no readable config.json)"
        ) from None
    if "model_type" not in config:
        raise UserError(f"model.pretrained: {pretrained}/config.json names no model_type; not a transformers model")


def cannot_load(what: str, exc: Exception) -> UserError:
    """model.pretrained: what transformers could not load (`what`, e.g. "a tokenizer from 'x'"), and why."""
    return UserError(
        f"model.pretrained: cannot load {what} ({first_line(exc, 160) or type(exc).__name__}); "
        "give a local model folder, or a hub name on a connected machine"
    )
