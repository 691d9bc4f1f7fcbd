"""Shared by the benchmark contenders: the workloads, and one way to time an epoch.

Every contender builds the same model and data through ddplab's registries, with the same
seed, per-process batch and process count; only the training loop differs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import time

import torch

# Each workload: ddplab overrides that define model, data, batch. Steps per epoch are kept small.
WORKLOADS: dict[str, list[str]] = {
    "gpt": [
        "model.name=gpt",
        "data.name=text",
        "model.layers=2",
        "model.dim=128",
        "model.heads=4",
        "model.context=64",
        "training.batch_size=32",
        "data.limit=2048",  # 64 steps an epoch on one process: over 2 s at two
    ],
    "transformer": [
        "model.name=transformer",
        "data.name=synthetic_reviews",
        "data.tokenizer=hash",
        "data.num_samples=3000",
        "data.max_len=128",
        "model.layers=2",
        "model.dim=128",
        "model.heads=4",
        "training.batch_size=32",
        "data.limit=1536",
    ],
    # The digits' CNN (8x8 grey images, 10 classes, batch 32) on 40,000 generated images of their shape: an
    # epoch of over 2 s, where the 1,797 digits last 0.1 s and the time around an epoch's ends weighs on a ratio.
    "cnn": [
        "model.name=cnn",
        "data.name=synthetic",
        "data.num_samples=40000",
        "data.image_size=8",
        "training.batch_size=32",
    ],
    # The digits themselves: a one-step command (startup.py) and the contenders' own tests.
    "digits": ["model.name=cnn", "data.name=digits", "training.batch_size=32"],
    # nanoGPT's Shakespeare-character size (10.7 M parameters): a GPU workload.
    "gpt_medium": [
        "model.name=gpt",
        "data.name=text",
        "model.layers=6",
        "model.dim=384",
        "model.heads=6",
        "model.context=256",
        "training.batch_size=64",
    ],
}

# What every contender does the same way: no clipping, constant lr, no extras.
COMMON = [
    "training.clip_grad_norm=null",
    "training.schedule=constant",
    "training.warmup_steps=0",
    "training.lr=1e-3",
    "model.dropout=0",
    "logging.trackers=[]",
    "logging.progress=false",
    "checkpoint.save_best=false",
    "generate.max_new_tokens=0",
    "logging.log_every=50",
]


def contender_args(argv: list[str] | None = None) -> argparse.Namespace:
    """What every contender script takes: WORKLOAD EPOCHS OUT [--device] [--amp] [--compile]."""
    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=list(WORKLOADS))
    p.add_argument("epochs", type=int)
    p.add_argument("out")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--amp", choices=("none", "bf16"), default="none")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (hand-written loop only)")
    p.add_argument(
        "--alternate", action="store_true", help="interleaved only: the hand-written epoch goes first on odd epochs"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra ddplab override (ddplab's own contender only)",
    )
    return p.parse_args(argv)


def overrides(args: argparse.Namespace) -> list[str]:
    extra = [f"training.epochs={args.epochs}", f"training.compile={args.compile}"]
    if args.amp != "none":
        extra.append(f"training.amp={args.amp}")
    return WORKLOADS[args.workload] + COMMON + extra + args.set


def device_of(args: argparse.Namespace) -> torch.device:
    if args.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def setup(args: argparse.Namespace):
    """(cfg, ctx, data, model) exactly as ddplab builds them; the caller owns the process group."""
    from ddplab.engine.loop.rng import seed_everything
    from ddplab.engine.loop.setup import build_data, build_model
    from ddplab.engine.parallel.distributed import DistContext, detect_launch
    from ddplab.registry import load_config, workload

    cfg = load_config(None, overrides(args))
    launch = detect_launch()
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    ctx = DistContext(launch=launch, backend=backend, device=device_of(args))
    seed_everything(cfg.experiment.seed)
    work = workload(cfg)
    data = build_data(cfg, ctx, work)
    model = build_model(cfg, ctx, work, data)
    seed_everything(cfg.experiment.seed + launch.rank)
    return cfg, ctx, data, model


def make_optimizer(model: torch.nn.Module, cfg) -> torch.optim.Optimizer:
    """The maths ddplab uses (AdamW, the same parameter groups), with torch's default kernels:
    what a user writing the loop by hand gets; ddplab's own speed defaults are its own."""
    from ddplab.engine.loop.optim import adamw_groups

    return torch.optim.AdamW(adamw_groups(model, cfg.training.weight_decay), lr=cfg.training.lr, betas=(0.9, 0.95))


def move(obj, device: torch.device):
    """Plain `.to(device)` of a batch's tensors, as a hand-written loop does."""
    if isinstance(obj, dict):
        return {k: v.to(device) for k, v in obj.items()}
    return obj.to(device)


def unpack(batch):
    """(inputs, target) of a batch: a pair, or a dict of the text workloads whose `labels` is the target."""
    if isinstance(batch, dict):
        inputs = dict(batch)
        return inputs, inputs.pop("labels")
    return batch


def autocast(args: argparse.Namespace, device: torch.device):
    if args.amp == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so an epoch's time holds all of its steps."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores{gpu}, torch {torch.__version__}, python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}"
    )


def paired_ratio(a: list[float], b: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The ratio a/b of two contenders timed in pairs (run i of a next to run i of b), with its
    confidence interval: the geometric mean of the pair ratios, and a Student-t interval on the
    mean of their logs, so slow drifts of the machine, which hit both runs of a pair, cancel.
    Fewer than two pairs give an unbounded interval."""
    from scipy.stats import t

    logs = [math.log(x / y) for x, y in zip(a, b, strict=True)]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf
    half = t.ppf(0.5 + level / 2, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def resolved(ratio: float, lo: float, hi: float, within: float) -> bool:
    """Whether the interval lies within +-`within` (a fraction) of the ratio."""
    return hi / ratio - 1 <= within and 1 - lo / ratio <= within
