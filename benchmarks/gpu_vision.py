"""Image training at the device's speed: ddplab beside a hand-written torchvision loop and beside the
model alone, on a JPEG ImageFolder tree (the image cache's build rate: image_cache_build.py, on such a tree).

It writes a tree of photo-like JPEGs (smooth gradients and a little noise, one hue per class; no
validation split, so epochs are training only), then times, in fresh processes, alternating runs:

    ceiling    the model alone on random tensors already on the device (channels_last and bf16 on CUDA)
    hand       torchvision's ImageFolder + Resize/CenterCrop/Normalize, DataLoader workers, pinned
               memory, bf16 autocast and channels_last on CUDA
    raw, jpeg, nocache   ddplab with data.cache=raw / jpeg / false (its defaults otherwise)
    gpu        ddplab with data.cache=false data.decode=gpu (CUDA only)

Each run's images/s comes from a continuous wall clock from the end of epoch 1 to the end of the
last epoch (ddplab: a callback; the others: their own loop), snapshots included; for ddplab also
the throughput metrics.csv reports for those epochs (images over their epoch_time_s) against the
same clock less the rows' eval_time_s and snapshot_time_s, printed as reported/real. Then:

    ratio <run>/hand <value>      ratio <run>/ceiling <value>

    PYTHONPATH=src python3 benchmarks/gpu_vision.py                  # defaults fit the device found
    PYTHONPATH=src python3 benchmarks/gpu_vision.py --per-class 1100 --side 320 --model resnet50
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

CUDA = torch.cuda.is_available()


def arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--classes", type=int, default=10 if CUDA else 4)
    p.add_argument("--per-class", type=int, default=1100 if CUDA else 32, help="images per class")
    p.add_argument("--side", type=int, default=320 if CUDA else 96, help="side of the JPEG files")
    p.add_argument("--image-size", type=int, default=224 if CUDA else 32, help="training side (data.image_size)")
    p.add_argument("--model", default="resnet50" if CUDA else "resnet18", help="a torchvision classifier")
    p.add_argument("--batch-size", type=int, default=128 if CUDA else 32)
    p.add_argument("--epochs", type=int, default=3, help="epoch 1 is the warm-up; 2+ are timed")
    p.add_argument("--runs", type=int, default=3 if CUDA else 2, help="alternating rounds of every contender")
    p.add_argument(
        "--workers", type=int, default=None, help="the hand loop's DataLoader workers; default: cores - 1, at most 12"
    )
    p.add_argument("--only", default="ceiling,hand,raw,jpeg,nocache,gpu", help="comma-separated subset")
    p.add_argument("--root", default=None, help="folder for the tree and caches (default: a temporary one)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def photo_tree(root: Path, args) -> Path:
    """args.classes folders of args.per_class JPEGs (quality 90), seeded; kept when already written."""
    done = root / "train" / ".complete"
    if done.is_file():
        return root / "train"
    from PIL import Image

    rng, side = np.random.default_rng(0), args.side
    yy, xx = np.mgrid[0:side, 0:side] / side
    for c in range(args.classes):
        folder = root / "train" / f"class_{c:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        hue = np.array([(c * 67) % 255, (c * 131) % 255, (c * 29) % 255]) / 255
        for i in range(args.per_class):
            a, b = rng.uniform(0.3, 1, 2)
            planes = np.stack([a * xx + hue[0] * yy, b * yy + hue[1] * xx, (xx + yy) / 2 * hue[2] + 0.2], -1)
            pixels = planes / planes.max() * 230 + rng.normal(0, 4, (side, side, 3))
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i:05d}.jpg", quality=90)
    done.touch()
    return root / "train"


# ---------------------------------------------------------------------------- contenders (child processes)


def _device_step(model, optimizer, x, y, device):
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _model(args, device):
    import torchvision

    model = getattr(torchvision.models, args.model)(num_classes=args.classes).to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ceiling(args, tree: Path) -> dict:
    """The model alone: one epoch's worth of steps on tensors already on the device, per epoch."""
    device = torch.device("cuda" if CUDA else "cpu")
    model, optimizer = _model(args, device)
    n = args.classes * args.per_class
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    x = x.to(memory_format=torch.channels_last) if CUDA else x
    y = torch.randint(0, args.classes, (args.batch_size,), device=device)
    ends = []
    for _ in range(args.epochs):
        for _ in range(-(-n // args.batch_size)):
            _device_step(model, optimizer, x, y, device)
        _sync(device)
        ends.append(time.perf_counter())
    return {"real": n * (args.epochs - 1) / (ends[-1] - ends[0])}


def hand(args, tree: Path) -> dict:
    """What a user writes with torchvision: decode, resize and crop every image every epoch in workers."""
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    device = torch.device("cuda" if CUDA else "cpu")
    tf = transforms.Compose(
        [
            transforms.Resize(args.image_size),
            transforms.CenterCrop(args.image_size),
            transforms.ToTensor(),
            transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
        ]
    )
    workers = args.workers if args.workers is not None else min(12, max(1, cores() - 1))
    loader = DataLoader(
        datasets.ImageFolder(str(tree), tf),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=workers,
        pin_memory=CUDA,
        persistent_workers=workers > 0,
    )
    model, optimizer = _model(args, device)
    ends = []
    for _ in range(args.epochs):
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            _device_step(
                model,
                optimizer,
                x.to(memory_format=torch.channels_last) if CUDA else x,
                y.to(device, non_blocking=True),
                device,
            )
        _sync(device)
        ends.append(time.perf_counter())
    return {"real": len(loader.dataset) * (args.epochs - 1) / (ends[-1] - ends[0]), "workers": workers}


DDPLAB = {
    "raw": ["data.cache=raw"],
    "jpeg": ["data.cache=jpeg"],
    "nocache": ["data.cache=false"],
    "gpu": ["data.cache=false", "data.decode=gpu"],
}


def run_ddplab(args, tree: Path, kind: str) -> dict:
    """`ddplab.train` as a user calls it, with a callback that holds a continuous clock."""
    import ddplab

    class Clock(ddplab.Callback):
        def __init__(self):
            self.start, self.ends = None, []

        def on_train_start(self, view):
            self.start = time.perf_counter()

        def on_epoch_end(self, view, row):
            self.ends.append(time.perf_counter())

    clock, out, name = Clock(), Path(args.root) / "experiments", f"{kind}-{time.time_ns()}"
    overrides = [
        f"model.name={args.model}",
        "data.name=image_folder",
        f"data.root={tree}",
        f"data.image_size={args.image_size}",
        "data.val_fraction=0",
        "data.test_fraction=0",
        f"data.cache_dir={Path(args.root) / 'cache'}",
        f"training.batch_size={args.batch_size}",
        f"training.epochs={args.epochs}",
        f"training.amp={'bf16' if CUDA else 'none'}",
        "training.lr=1e-3",
        "logging.trackers=[]",
        "logging.progress=false",
        "logging.plots=false",
        f"experiment.output_dir={out}",
        f"experiment.name={name}",
        "checkpoint.resume=never",
        "checkpoint.keep_last=1",
        *DDPLAB[kind],
    ]
    ddplab.train(None, overrides, callbacks=[clock])
    n = args.classes * args.per_class
    rows = list(csv.DictReader(open(out / name / "metrics.csv")))
    shutil.rmtree(out / name)  # a run folder per run: its snapshots would add up on disk
    if len(rows) < 2:  # the run that builds the cache before the timed ones
        return {}
    span = clock.ends[-1] - clock.ends[0]
    real = n * (args.epochs - 1) / span  # everything a user waits for, snapshots included
    # What the rows claim to time is the span less their evaluations and snapshots: compared like for like.
    aside = sum(float(r["eval_time_s"] or 0) + float(r["snapshot_time_s"] or 0) for r in rows[1:])
    reported = n * (args.epochs - 1) / sum(float(r["epoch_time_s"]) for r in rows[1:])
    return {
        "real": real,
        "reported_over_real": reported / (n * (args.epochs - 1) / (span - aside)),
        "epoch1": n / (clock.ends[0] - clock.start),
    }


def child(args) -> None:
    tree = Path(args.root) / "train"
    result = (
        ceiling(args, tree)
        if args.child == "ceiling"
        else hand(args, tree)
        if args.child == "hand"
        else run_ddplab(args, tree, args.child)
    )
    Path(args.out).write_text(json.dumps(result))


# ---------------------------------------------------------------------------- the parent


def in_child(argv: list[str], kind: str, root: Path) -> dict:
    out = root / f"{kind}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        *argv,
        "--root",
        str(root),
        "--child",
        kind,
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{kind} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = arguments(argv)
    if args.child:
        return child(args)
    root = Path(args.root or tempfile.mkdtemp(prefix="gpu_vision-"))
    root.mkdir(parents=True, exist_ok=True)
    photo_tree(root, args)
    passed = [a for i, a in enumerate(argv) if a != "--root" and (i == 0 or argv[i - 1] != "--root")]
    wanted = [k for k in args.only.split(",") if k and (k != "gpu" or CUDA)]
    n = args.classes * args.per_class
    print(
        f"device {torch.cuda.get_device_name() if CUDA else 'cpu'}, {cores()} cores, torch {torch.__version__}, "
        f"python {sys.version.split()[0]}; {n} JPEGs {args.side}px -> {args.image_size}, {args.model}, "
        f"batch {args.batch_size}, {args.epochs} epochs, {args.runs} runs",
        flush=True,
    )
    results: dict[str, list[dict]] = {}
    if "raw" in wanted or "jpeg" in wanted:  # the caches are built once, before any timed run
        for kind in ("raw", "jpeg"):
            in_child([*passed, "--epochs", "1"], kind, root) if kind in wanted else None
    for r in range(args.runs):
        for kind in wanted:
            results.setdefault(kind, []).append(in_child(passed, kind, root))
            print(f"run {r + 1} {kind}: {json.dumps(results[kind][-1])}", flush=True)
    real = {k: statistics.median(x["real"] for x in v) for k, v in results.items()}
    print(f"\n{'run':<10}{'images/s':>10}{'range':>20}{'reported/real':>15}{'epoch 1':>10}")
    for kind, runs in results.items():
        lo, hi = min(x["real"] for x in runs), max(x["real"] for x in runs)
        ratio = statistics.median(x["reported_over_real"] for x in runs) if "reported_over_real" in runs[0] else None
        first = statistics.median(x["epoch1"] for x in runs) if "epoch1" in runs[0] else None
        print(
            f"{kind:<10}{real[kind]:>10.0f}{f'{lo:.0f}-{hi:.0f}':>20}{ratio or float('nan'):>15.3f}"
            f"{first or float('nan'):>10.0f}"
        )
    for kind in real:
        for base in ("hand", "ceiling"):
            if base in real and kind != base:
                print(f"ratio {kind}/{base} {real[kind] / real[base]:.3f}")


if __name__ == "__main__":
    main()
