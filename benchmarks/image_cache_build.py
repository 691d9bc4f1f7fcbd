"""The image cache's build rate with a pool of processes over the host's cores, against one process's decode rate,
on a tree of photo-like JPEGs (gpu_vision.py's; default 2,400 at 224 px, cached at 224, data.cache=raw):

    one, pool   image_cache.write with one process and with the pool (its default), each into a fresh folder
    train       the build in the real training path: `ddplab train` (cnn, one step) in a fresh process with an
                empty cache folder (cold), then again with the cache in place (warm); the cold run's data phase
                (metrics.json) less the warm run's is the build

Rounds alternate the order of one and pool. Each round prints its rates, and for one and pool the CPU time an
image over all their processes (what the pool adds to the work, whatever else the host runs); then the medians,
with their range, and the ratios against one process: `ratio pool/one <median> (<range over rounds>)` and
`ratio train/one ...`, with the load average before and after (2 cores cap both at 2x).

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/image_cache_build.py [--runs 3] [--per-class 600]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_vision import photo_tree
from torchvision.datasets import ImageFolder

from ddplab.data import image_cache


def arguments(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--per-class", type=int, default=600, help="JPEGs per class")
    p.add_argument("--side", type=int, default=224, help="side of the JPEG files")
    p.add_argument("--image-size", type=int, default=224, help="side cached (data.image_size)")
    p.add_argument("--runs", type=int, default=3, help="alternating rounds")
    p.add_argument("--root", default=None, help="folder for the tree and the caches (default: a temporary one)")
    return p.parse_args(argv)


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (the pool's, once it shuts down)."""
    own, ended = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime


def write_rate(samples, args, folder: Path, workers: int | None) -> tuple[float, float]:
    """images/s of image_cache.write, and the CPU milliseconds it spent an image over all its processes."""
    meta = {"image_size": args.image_size, "source_channels": 3}
    began, cpu = time.perf_counter(), cpu_seconds()
    image_cache.write(folder, samples, meta, "raw", workers=workers, log=lambda line: None)
    took, cpu = time.perf_counter() - began, cpu_seconds() - cpu
    shutil.rmtree(folder)
    return len(samples) / took, 1e3 * cpu / len(samples)


def data_phase(args, tree: Path, cache: Path, out: Path) -> float:
    """Seconds of the data phase of `ddplab train`, one step, in a fresh process."""
    name = f"run-{time.time_ns()}"
    cmd = [
        *(sys.executable, "-m", "ddplab", "train", "model.name=cnn", "data.name=image_folder"),
        *(f"data.root={tree}", f"data.image_size={args.image_size}", f"data.cache_dir={cache}"),
        *("data.cache=raw", "data.val_fraction=0", "data.test_fraction=0", "training.max_steps=1"),
        *("training.batch_size=8", "logging.trackers=[]", "logging.progress=false", "logging.plots=false"),
        *(f"experiment.output_dir={out}", f"experiment.name={name}", "checkpoint.resume=never"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"ddplab train failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    seconds = json.loads((out / name / "metrics.json").read_text())["phases"]["data_s"]
    shutil.rmtree(out / name)
    return seconds


def main(argv=None) -> None:
    args = arguments(argv)
    root = Path(args.root or tempfile.mkdtemp(prefix="image_cache_build-"))
    root.mkdir(parents=True, exist_ok=True)
    tree = photo_tree(root, args)
    samples = ImageFolder(str(tree)).samples
    n = len(samples)
    print(
        f"{n} JPEGs {args.side}px -> {args.image_size}, raw; {image_cache.host_cores()} cores; {args.runs} rounds; "
        f"load average {os.getloadavg()[0]:.2f} before",
        flush=True,
    )
    rates: dict[str, list[float]] = {"one": [], "pool": [], "train": []}
    cpu: dict[str, list[float]] = {"one": [], "pool": []}
    for r in range(args.runs):
        for name in ("one", "pool") if r % 2 == 0 else ("pool", "one"):
            rate, ms = write_rate(samples, args, root / "write", 1 if name == "one" else None)
            rates[name].append(rate), cpu[name].append(ms)
        cache = root / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        cold, warm = (data_phase(args, tree, cache, root / "runs") for _ in range(2))
        rates["train"].append(n / (cold - warm))
        print(
            f"round {r + 1}: one {rates['one'][-1]:.0f} images/s ({cpu['one'][-1]:.2f} CPU ms an image), pool "
            f"{rates['pool'][-1]:.0f} ({cpu['pool'][-1]:.2f}), in training {rates['train'][-1]:.0f} (data phase "
            f"cold {cold:.2f} s, warm {warm:.2f} s); load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    print(f"load average {os.getloadavg()[0]:.2f} after")
    for name, values in rates.items():
        line = f"{name:<6} median {statistics.median(values):6.0f} images/s ({min(values):.0f}-{max(values):.0f})"
        if name in cpu:
            line += f", {statistics.median(cpu[name]):.2f} CPU ms an image ({min(cpu[name]):.2f}-{max(cpu[name]):.2f})"
        print(line)
    for name in ("pool", "train"):
        ratios = [a / b for a, b in zip(rates[name], rates["one"], strict=True)]
        print(f"ratio {name}/one {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
