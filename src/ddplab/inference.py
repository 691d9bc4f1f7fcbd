"""Loading a trained model back from a run folder or checkpoint, for `predict` and `generate`.

The run's own workload rebuilds it, built-in or the user's (imported only from the path the run
recorded, and only code this machine trained with, an installed module, or with --trust-code): `predict`
rebuilds the run's Data through its data function, then the model through its model function;
`generate` builds the model from the task and meta the checkpoint stored (a character model
needs nothing else, and its corpus may be gone). Then come the checkpoint's weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddplab.config import Config
from ddplab.config_io import from_dict
from ddplab.data.text_lm import CharTokenizer
from ddplab.engine.checkpoint import load_checkpoint
from ddplab.engine.setup import build_data, build_model
from ddplab.errors import UserError, first_line
from ddplab.registry import workload
from ddplab.tasks import restore
from ddplab.workload import Data, build_config, check_trusted


def read_checkpoint(path: str | Path) -> tuple[dict, Config]:
    """(checkpoint dict, its Config) from a run folder or checkpoint file, checked against its manifest."""
    _, ckpt = load_checkpoint(path)
    cfg = from_dict(ckpt["config"])
    cfg.model.weights = None  # the checkpoint holds every weight; the original file may be gone
    return ckpt, cfg


def recorded_task(ckpt: dict):
    """The task the checkpoint describes (what generate needs; predict uses the run's own)."""
    meta = ckpt.get("meta", {})
    return restore(ckpt.get("task"), ckpt.get("num_classes"), ckpt.get("vocab_size") or meta.get("vocab_size"))


def load_model(path: str | Path, trust_code: bool = False, rebuild_data: bool = False, checkpoint=None):
    """(model in eval mode, checkpoint dict, Data). With rebuild_data the Data is the run's own,
    from its data function (with its preprocess, datasets and task); else the checkpoint's task and
    meta only. `checkpoint`: what read_checkpoint(path) gave, when the caller has read it already."""
    ckpt, cfg = checkpoint or read_checkpoint(path)
    meta = ckpt.get("meta", {})
    check_trusted(cfg.model.name, trust_code, "model.name", path)
    check_trusted(cfg.data.name, trust_code, "data.name", path)
    work = workload(cfg)
    if rebuild_data:
        data = build_data(cfg, None, work)
        data.meta = {**data.meta, **meta}  # what the weights were trained with wins
        model = _rebuilt(cfg, lambda: build_model(cfg, None, work, data))
    else:
        shape = meta.get("input_shape")
        data = Data(train=None, task=recorded_task(ckpt), meta=meta, input_shape=tuple(shape) if shape else None)
        model = _rebuilt(cfg, lambda: work.model(build_config(cfg, "model"), data))
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        raise UserError(f"{path}: the checkpoint's weights do not fit the model its config builds "
                        f"({first_line(exc, 160)})") from None
    model.eval()
    return model, ckpt, data


def _rebuilt(cfg, build) -> torch.nn.Module:
    try:
        model = build()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported in one line
        raise UserError(f"model.name={cfg.model.name} cannot be rebuilt from the checkpoint "
                        f"({type(exc).__name__}: {first_line(exc, 160)})") from None
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model.name={cfg.model.name} returned {type(model).__name__}, not a torch.nn.Module")
    return model


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
