"""Sampling from a trained character / byte language model."""

from __future__ import annotations

from pathlib import Path

import torch

from ddplab.config import from_dict
from ddplab.data.bundle import DataBundle
from ddplab.data.text_lm import CharTokenizer
from ddplab.engine.checkpoint import BEST, load_file
from ddplab.errors import UserError


def find_checkpoint(path: str | Path) -> Path:
    """A run folder (its best model, else its newest snapshot) or a checkpoint file."""
    p = Path(path)
    if p.is_file():
        return p
    if p.is_dir():
        for candidate in (p / "checkpoints" / BEST, p / BEST):
            if candidate.is_file():
                return candidate
        snaps = sorted((p / "checkpoints").glob("step-*/state.pt")) if (p / "checkpoints").is_dir() else []
        if snaps:
            return snaps[-1]
        raise UserError(f"no checkpoint in {path} (expected checkpoints/{BEST})")
    raise UserError(f"no such run folder or checkpoint: {path}")


def load_model(path: str | Path):
    """(model in eval mode, checkpoint dict) from a run folder or checkpoint file."""
    from ddplab.models import build_model

    ckpt = load_file(find_checkpoint(path))
    cfg = from_dict(ckpt["config"])
    cfg.model.weights = None  # the checkpoint holds every weight; the original file may be gone
    meta = ckpt.get("meta", {})
    bundle = DataBundle(task=ckpt.get("task", "lm"), train=[], val=None, num_classes=ckpt.get("num_classes"),
                        vocab_size=ckpt.get("vocab_size") or meta.get("vocab_size"), meta=meta)
    model = build_model(cfg, bundle)
    model.load_state_dict(ckpt["model"])
    model.eval()
    return model, ckpt


def sample(model, meta: dict, prompt: str, max_new_tokens: int, temperature: float = 0.8,
           top_k: int | None = 40, seed: int = 0) -> str:
    if meta.get("tokenizer") not in ("char", "byte"):
        raise UserError("this checkpoint is not a character / byte language model")
    tokenizer = CharTokenizer.from_meta(meta)
    ids = tokenizer.encode(prompt or "\n")
    device = next(model.parameters()).device
    idx = torch.as_tensor(ids, dtype=torch.long, device=device)[None, :]
    g = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=g)
    model.train(was_training)
    return tokenizer.decode(out[0].tolist())
