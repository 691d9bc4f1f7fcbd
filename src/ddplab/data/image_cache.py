"""The on-disk image cache: decode an image tree once, then every rank memory-maps it read-only.

Decoding a PNG or JPEG and resizing it costs far more than a small model's step, and an
ImageFolder pays it for every image of every epoch. Here the tree is decoded once, after the
deterministic part of the validation transform (resize + centre crop to `data.image_size`),
into `images-<key>/images.npy`, an (N, C, S, S) uint8 array, with `labels.npy` and `meta.json`.
The key hashes every file's path, size and modification time, and the transform settings, so an
edited, added or removed image, or another image size, gives a new cache. Like the token cache,
the folder is written under a temporary name and renamed into place (`meta.json` last), built by
one rank while the others wait. What stays per epoch: conversion to float, normalisation, and
the random augmentations (`data.augment`), on the cached uint8 images.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset
from torchvision.transforms import v2

from ddplab.data import text_cache
from ddplab.errors import UserError

VERSION = 1  # bump when the layout or the decode steps change
CHUNK = 256  # images decoded per write


class ImageBatch(NamedTuple):
    """A batch fetched whole: (N, C, H, W) images and their (N,) int64 labels."""

    images: torch.Tensor
    labels: torch.Tensor


def describe(samples: list[tuple[str, int]], root: str | Path, meta: dict) -> dict:
    """What the key hashes: each file's path (relative to the tree), size, mtime and class, and the decode settings."""
    root = Path(root)
    files = []
    for path, label in samples:
        st = os.stat(path)
        files.append((str(Path(path).relative_to(root)), st.st_size, st.st_mtime_ns, int(label)))
    return {"version": VERSION, "root": str(root.resolve()), "files": files, "image_size": meta["image_size"],
            "mode": pil_mode(meta), "steps": "to_image,resize(antialias),center_crop"}


def cache_folder(cache_dir: str | Path, description: dict) -> Path:
    blob = json.dumps(description, sort_keys=True)
    return Path(cache_dir) / f"images-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"


def pil_mode(meta: dict) -> str:
    """Images are read as stored: grey stays one channel (a model that needs RGB repeats it later)."""
    return "L" if meta["source_channels"] == 1 else "RGB"


def decode_steps(meta: dict):
    """PIL image -> uint8 (C, S, S): the deterministic head of `vision.transform`."""
    side = meta["image_size"]
    return v2.Compose([v2.ToImage(), v2.Resize(side, antialias=True), v2.CenterCrop(side)])


def on_the_fly(meta: dict):
    """uint8 (..., C, S, S) -> normalised float: the tail of `vision.transform`, batch or item;
    grey becomes RGB here when the model needs 3 channels."""
    rgb = [v2.RGB()] if meta["channels"] == 3 else []
    return v2.Compose([v2.ToImage(), *rgb, v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(meta["mean"], meta["std"])])


def write(folder: Path, samples: list[tuple[str, int]], meta: dict, log: Callable[[str], None] = print) -> None:
    """Decode `samples` (path, label) into `folder`, atomically."""
    n, side = len(samples), meta["image_size"]
    channels = 1 if pil_mode(meta) == "L" else 3
    folder.parent.mkdir(parents=True, exist_ok=True)
    need = n * channels * side * side + 8 * n
    free = shutil.disk_usage(folder.parent).free
    log(f"image cache: decoding {n} images to {channels}x{side}x{side} uint8, about {_size(need)} on disk "
        f"({_size(free)} free), into {folder}")
    if need > free:
        raise UserError(f"data.cache: the image cache needs about {_size(need)} but {folder.parent} has "
                        f"{_size(free)} free; set data.cache_dir=<bigger disk> or data.cache=false")
    with text_cache.building(folder) as tmp:
        offset = text_cache.npy_offset(tmp / "images.npy", np.uint8, (n, channels, side, side))
        np.save(tmp / "labels.npy", np.asarray([label for _, label in samples], dtype=np.int64))
        steps = decode_steps(meta)
        with open(tmp / "images.npy", "r+b") as f:
            f.seek(offset)
            for start in range(0, n, CHUNK):
                block = []
                for path, _ in samples[start:start + CHUNK]:
                    try:
                        with Image.open(path) as img:
                            block.append(steps(img.convert(pil_mode(meta))).numpy())
                    except (UnidentifiedImageError, OSError):
                        raise UserError(f"data.root: cannot read {path} as an image") from None
                f.write(np.ascontiguousarray(np.stack(block)).tobytes())
        (tmp / text_cache.META).write_text(json.dumps({"size": n, "shape": [channels, side, side], "version": VERSION}))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class CachedImages(Dataset):
    """Read-only view of a complete cache: items are (normalised float (C, S, S), label).

    `transform` starts as the batch-safe normalisation, so whole batches are fetched in one
    indexing op; once augmentation is composed in (a per-item random crop), items go one by one.
    The array is opened lazily, so pickling (DataLoader workers) sends the path, not the pixels.
    """

    def __init__(self, folder: str | Path, meta: dict) -> None:
        self.folder = Path(folder)
        self.labels = torch.from_numpy(np.load(self.folder / "labels.npy"))
        self.transform = self.batch_transform = on_the_fly(meta)
        self._images: np.ndarray | None = None

    @property
    def images(self) -> np.ndarray:
        if self._images is None:
            self._images = np.load(self.folder / "images.npy", mmap_mode="r")
        return self._images

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = torch.from_numpy(np.array(self.images[i]))
        return self.transform(x).as_subclass(torch.Tensor), int(self.labels[i])

    def __getitems__(self, indices: list[int]):
        if self.transform is not self.batch_transform:
            return [self[i] for i in indices]
        at = np.asarray(indices, dtype=np.int64)
        x = torch.from_numpy(self.images[at])  # fancy indexing copies the rows out of the map
        return ImageBatch(self.batch_transform(x).as_subclass(torch.Tensor), self.labels[torch.from_numpy(at)])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_images": None}


def cached_folder(cfg, dist, dataset, meta: dict) -> CachedImages:
    """An ImageFolder's samples, decoded once into the cache: by the first rank of each node while
    the others wait (`dist`, the job), or here and now outside a job (dist=None, e.g. predict)."""
    folder = cache_folder(text_cache.cache_root(cfg), describe(dataset.samples, dataset.root, meta))

    text_cache.ensure(dist, folder, lambda: write(folder, dataset.samples, meta, log=partial(print, flush=True)),
                      what="image cache")
    return CachedImages(folder, meta)
