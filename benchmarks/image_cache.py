"""image_folder throughput against the IDX tensor path, on the same images, with and without the image cache.

scikit-learn's 1797 digits, upscaled to 28x28 grey, are written twice: as PNG files in an
ImageFolder tree (train/<class>/, test/<class>/) and as FashionMNIST IDX files holding the same
images in the same order, so both paths split off the same validation images. Then the CNN
trains on each, runs alternating:

    idx         data.name=fashion_mnist (uint8 tensors, normalised once)
    png-nocache data.name=image_folder data.cache=false (every PNG decoded every epoch)
    png-cache   data.name=image_folder (decoded once into the memory-mapped cache)

and it prints the DataLoader's own images/s per path (no model), the median training images/s per path
(the first epoch of every run is a warm-up and not counted; the cache is built before the timed runs) and

    ratio image_folder/idx cache=<on|off> nproc=<N> <value>

Both run at default settings: an image_folder tree is read at its images' own size and mode
(every PNG here is 28x28 grey, so 1x28x28, as the IDX files give), the size read from the
file headers.

    python benchmarks/image_cache.py                   # 1 process, 5 runs of 3 epochs each
    python benchmarks/image_cache.py --nproc 2 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SIDE = 28


def export(root: Path) -> None:
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    grey = np.rint(digits.images * 255 / 16).astype(np.uint8)
    big = np.stack([np.asarray(Image.fromarray(g).resize((SIDE, SIDE), Image.BILINEAR)) for g in grey])
    n_test = len(big) // 10
    split = {"train": np.arange(n_test, len(big)), "test": np.arange(n_test)}
    for name, rows in split.items():
        # ImageFolder lists class by class, file names in order: the IDX file follows that order.
        rows = rows[np.lexsort((rows, digits.target[rows]))]
        for i in rows:
            folder = root / "png" / name / str(digits.target[i])
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(big[i]).save(folder / f"{i:05d}.png")
        prefix = "train" if name == "train" else "t10k"
        write_idx(root / "idx" / "FashionMNIST" / "raw" / f"{prefix}-images-idx3-ubyte", big[rows])
        write_idx(
            root / "idx" / "FashionMNIST" / "raw" / f"{prefix}-labels-idx1-ubyte", digits.target[rows].astype(np.uint8)
        )


def write_idx(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def train(root: Path, path: str, nproc: int, epochs: int, run: int) -> list[float]:
    data = {
        "idx": ["data.name=fashion_mnist", f"data.root={root / 'idx'}"],
        "png-nocache": ["data.name=image_folder", f"data.root={root / 'png'}", "data.cache=false"],
        "png-cache": ["data.name=image_folder", f"data.root={root / 'png'}"],
    }[path]
    name = f"{path}-{run}"
    cmd = [
        sys.executable,
        "-m",
        "ddplab",
        "train",
        "--nproc-per-node",
        str(nproc),
        *data,
        "model.name=cnn",
        "training.batch_size=32",
        f"training.epochs={epochs}",
        "logging.trackers=[]",
        "logging.progress=false",
        "checkpoint.save_best=false",
        f"experiment.output_dir={root / 'runs'}",
        f"experiment.name={name}",
        f"data.cache_dir={root / 'cache'}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} failed:\n{proc.stderr[-3000:]}")
    epochs_rows = json.loads((root / "runs" / name / "metrics.json").read_text())["epochs"]
    return [r["samples_per_s"] * nproc for r in epochs_rows[1:]]  # samples_per_s is per process


def loader_rate(root: Path, path: str, passes: int = 3) -> float:
    """Images/s of the training DataLoader alone (no model): what the data path costs by itself."""
    import time

    import torch
    from torch.utils.data import DataLoader

    from ddplab.engine.loop.setup import build_data
    from ddplab.registry import load_config, workload

    data = {
        "idx": ["data.name=fashion_mnist", f"data.root={root / 'idx'}"],
        "png-nocache": ["data.name=image_folder", f"data.root={root / 'png'}", "data.cache=false"],
        "png-cache": ["data.name=image_folder", f"data.root={root / 'png'}"],
    }[path]
    cfg = load_config(None, [*data, "model.name=cnn", f"data.cache_dir={root / 'cache'}"])
    torch.set_num_threads(1)
    built = build_data(cfg, None, workload(cfg))
    loader = DataLoader(built.train, batch_size=32, shuffle=True, collate_fn=built.collate_fn)
    start, n = time.perf_counter(), 0
    for _ in range(passes):
        for images, _labels in loader:
            n += len(images)
    return n / (time.perf_counter() - start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3, help="epochs per run; the first is a warm-up")
    p.add_argument("--paths", default="idx,png-nocache,png-cache")
    args = p.parse_args()
    paths = args.paths.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        export(root)
        if "png-cache" in paths:
            train(root, "png-cache", args.nproc, 2, 0)  # builds the cache: every timed run reuses it
        print("training DataLoader alone, no model (3 passes, in this process):")
        for path in paths:
            print(f"  loader {path:12s} {loader_rate(root, path):8.0f} images/s", flush=True)
        print(
            f"load average before: {os.getloadavg()[0]:.2f}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}"
        )
        rates: dict[str, list[float]] = {k: [] for k in paths}
        for i in range(args.runs):
            for path in paths[i % len(paths) :] + paths[: i % len(paths)]:
                rates[path].append(statistics.mean(train(root, path, args.nproc, args.epochs, i + 1)))
                print(f"  run {i + 1} {path} nproc={args.nproc}: {rates[path][-1]:.0f} images/s", flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        print(
            f"\nnproc={args.nproc}: median training images/s (all processes), "
            f"{args.runs} runs of {args.epochs - 1} timed epochs"
        )
        for path in paths:
            print(
                f"  {path:12s} {statistics.median(rates[path]):7.0f} "
                f"(min {min(rates[path]):.0f}, max {max(rates[path]):.0f})"
            )
        for path, cache in (("png-nocache", "off"), ("png-cache", "on")):
            if path in rates and "idx" in rates:
                ratio = statistics.median(rates[path]) / statistics.median(rates["idx"])
                print(f"ratio image_folder/idx cache={cache} nproc={args.nproc} {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
