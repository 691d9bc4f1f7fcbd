"""Loading a trained model back from a run folder or checkpoint, for `predict` and `generate`.

The model is rebuilt by the same builder training used (a built-in, or the user's function the
run recorded: imported only from that path, and only with consent when it lies outside the
current directory tree), then given the checkpoint's weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddplab.config_io import from_dict
from ddplab.engine.checkpoint import find_checkpoint, load_file
from ddplab.errors import UserError
from ddplab.registry import function
from ddplab.workload import build_config
from ddplab.tasks import restore
from ddplab.workload import Data, check_trusted


def load_model(path: str | Path, trust_code: bool = False):
    """(model in eval mode, checkpoint dict, task) from a run folder or checkpoint file."""
    ckpt = load_file(find_checkpoint(path))
    cfg = from_dict(ckpt["config"])
    cfg.model.weights = None  # the checkpoint holds every weight; the original file may be gone
    meta = ckpt.get("meta", {})
    task = restore(ckpt.get("task"), ckpt.get("num_classes"), ckpt.get("vocab_size") or meta.get("vocab_size"))
    shape = meta.get("input_shape")
    data = Data(train=None, task=task, meta=meta, input_shape=tuple(shape) if shape else None)
    check_trusted(cfg.model.name, trust_code, "model.name")
    model, task = _rebuild(cfg, data, trust_code)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:160]
        raise UserError(f"{path}: the checkpoint's weights do not fit the model its config builds ({first})") from None
    model.eval()
    return model, ckpt, task


def _rebuild(cfg, data: Data, trust_code: bool):
    """The model from the task and meta alone; a user model that reads its datasets (e.g. an
    input's shape) gets them from the run's own data function."""
    build = function(cfg.model.name, "model.name")
    try:
        return build(build_config(cfg, "model"), data), data.task
    except Exception as first:  # noqa: BLE001 - retried with the real data, or reported in one line
        if ":" not in cfg.data.name:
            raise UserError(f"model.name={cfg.model.name} cannot be rebuilt from the checkpoint "
                            f"({type(first).__name__}: {first})") from None
    from ddplab.engine.setup import build_data
    from ddplab.registry import workload

    check_trusted(cfg.data.name, trust_code, "data.name")
    full = build_data(cfg, None, workload(cfg))
    full.meta = data.meta
    try:
        return build(build_config(cfg, "model"), full), full.task  # the run's own task, not a plain one
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"model.name={cfg.model.name} cannot be rebuilt from the checkpoint "
                        f"({type(exc).__name__}: {exc})") from None


def sample(model, meta: dict, prompt: str, max_new_tokens: int, temperature: float = 0.8,
           top_k: int | None = 40, seed: int = 0) -> str:
    from ddplab.data.text_lm import CharTokenizer

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
