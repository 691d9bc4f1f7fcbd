"""Shared by the benchmark contenders: the workloads, and one way to time an epoch.

Every contender builds the same model and data through ddplab's registries, with the same
seed, per-process batch and process count; only the training loop differs.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

# Each workload: ddplab overrides that define model, data, batch. Steps per epoch are kept small.
WORKLOADS: dict[str, list[str]] = {
    "gpt": ["model.name=gpt", "data.name=text", "model.layers=2", "model.dim=128", "model.heads=4",
            "model.context=64", "training.batch_size=32", "data.limit=1536"],
    "transformer": ["model.name=transformer", "data.name=synthetic_reviews", "data.tokenizer=hash",
                    "data.num_samples=3000", "data.max_len=128", "model.layers=2", "model.dim=128", "model.heads=4",
                    "training.batch_size=32", "data.limit=1536"],
    "cnn": ["model.name=cnn", "data.name=digits", "training.batch_size=32"],
}

# What every contender does the same way: no clipping, constant lr, no extras.
COMMON = ["training.clip_grad_norm=null", "training.schedule=constant", "training.warmup_steps=0",
          "training.lr=1e-3", "model.dropout=0", "logging.tensorboard=false", "logging.progress=false",
          "checkpoint.save_best=false", "generate.max_new_tokens=0", "logging.log_every=50"]


def overrides(workload: str, epochs: int) -> list[str]:
    return WORKLOADS[workload] + COMMON + [f"training.epochs={epochs}"]


def setup(workload: str, epochs: int):
    """(cfg, ctx, bundle, model) exactly as ddplab builds them; the caller owns the process group."""
    from ddplab.config import load_config
    from ddplab.data import build_data
    from ddplab.distributed import DistContext, detect_launch
    from ddplab.engine.trainer import seed_everything
    from ddplab.models import build_model

    cfg = load_config(None, overrides(workload, epochs))
    launch = detect_launch()
    backend = "gloo" if torch.distributed.is_initialized() else None
    ctx = DistContext(launch=launch, backend=backend, device=torch.device("cpu"))
    seed_everything(cfg.experiment.seed)
    bundle = build_data(cfg, ctx)
    model = build_model(cfg, bundle)
    seed_everything(cfg.experiment.seed + launch.rank)
    return cfg, ctx, bundle, model


def call(model, inputs):
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out.logits if hasattr(out, "logits") else out


def loss_fn(logits, target):
    if logits.dim() == 3:  # language model
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
    return torch.nn.functional.cross_entropy(logits, target)


def report(out_path: str | None, epoch_times: list[float], extra: dict | None = None) -> None:
    if out_path and int(os.environ.get("RANK", "0")) == 0:
        with open(out_path, "w") as f:
            json.dump({"epoch_times": epoch_times, **(extra or {})}, f)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, python {platform.python_version()}, "
            f"{time.strftime('%Y-%m-%d')}")
