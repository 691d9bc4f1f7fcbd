"""The on-disk image cache: an image tree decoded once, then read by every rank.

Decoding and resizing an image costs far more than a small model's step, and an ImageFolder pays it for every
image of every epoch. Here the deterministic head of the validation transform (resize + centre crop) runs once,
over the host's cores, into `images-<key>/`: `data.cache=raw` an (N, C, S, S) uint8 `images.npy` the ranks
memory-map; `data.cache=jpeg` JPEGs at quality 90 in `images.bin` (a fifth of the disk or less), decoded per
epoch by the loader workers or the GPU (`data.decode=gpu`). The key hashes every file's path, size and mtime
and the decode settings, so any change to the tree gives a new cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_jpeg, encode_jpeg
from torchvision.transforms import v2

from ddplab.data import text_cache
from ddplab.errors import UserError, free_space, size_text

VERSION = 2  # bump when the layout or the decode steps change
QUALITY = 90  # data.cache=jpeg: visually lossless, about 0.1-0.2x raw on photographs
MARGIN = 1.1  # a raw cache must leave a tenth of itself free besides


class ImageBatch(NamedTuple):
    """A batch fetched whole: (N, C, H, W) images (or, under data.decode=gpu, still encoded) and their (N,)
    int64 labels."""

    images: torch.Tensor | EncodedImages
    labels: torch.Tensor


def pil_mode(meta: dict) -> str:
    """Images are read as stored: grey stays one channel (a model that needs RGB repeats it later)."""
    return "L" if meta["source_channels"] == 1 else "RGB"


def decode_steps(meta: dict):
    """PIL image -> uint8 (C, S, S): the deterministic head of `workloads.images.transform`."""
    side = meta["image_size"]
    return v2.Compose([v2.ToImage(), v2.Resize(side, antialias=True), v2.CenterCrop(side)])


def on_the_fly(meta: dict):
    """uint8 (..., C, S, S) -> normalised float: the tail of `workloads.images.transform`, batch or item;
    grey becomes RGB here when the model needs 3 channels."""
    rgb = [v2.RGB()] if meta["channels"] == 3 else []
    return v2.Compose(
        [v2.ToImage(), *rgb, v2.ToDtype(torch.float32, scale=True), v2.Normalize(meta["mean"], meta["std"])]
    )


def write(
    folder: Path,
    samples: list[tuple[str, int]],
    meta: dict,
    kind: str = "raw",
    workers: int | None = None,
    log: Callable[[str], None] = print,
) -> None:
    """Decode `samples` (path, label) into `folder`, atomically, over `workers` processes. A file that is no
    image fails it in one line, leaving nothing behind: not the folders made for it, nor a line about it."""
    made = next((p for p in reversed(folder.parents) if not p.exists()), None)  # the first folder this makes
    try:
        _write(folder, samples, meta, kind, workers, log)
    except BaseException:
        for p in (folder.parent, *folder.parent.parents) if made else ():
            with contextlib.suppress(OSError):
                p.rmdir()  # only where empty: what another writer put there stays
            if p == made:
                break
        raise


def _write(folder: Path, samples: list, meta: dict, kind: str, workers: int | None, log: Callable) -> None:
    n, side = len(samples), meta["image_size"]
    channels = 1 if pil_mode(meta) == "L" else 3
    folder.parent.mkdir(parents=True, exist_ok=True)
    raw, free = n * channels * side * side + 8 * n, free_space(folder.parent) or 0
    if kind == "raw" and raw * MARGIN > free:
        raise UserError(
            f"data.cache=raw: {n} images need about {size_text(raw)} at {channels}x{side}x{side} but "
            f"{folder.parent} has {size_text(free)} free; set data.cache=jpeg (re-encoded, a fifth of "
            f"the size or less) or data.cache_dir=<bigger disk>"
        )
    workers = workers or host_cores()
    chunk = max(8, min(256, n // (4 * workers) or 1))  # several chunks per worker, so the pool stays busy
    chunks = [(i, [path for path, _ in samples[i : i + chunk]]) for i in range(0, n, chunk)]
    workers = max(1, min(workers, len(chunks)))
    began = time.perf_counter()
    # Forked like the DataLoader's workers (no re-import of torch per worker), one thread each; the bar only in
    # terminals: a log gets the lines before and after.
    pool = (
        contextlib.nullcontext(SimpleNamespace(map=map))
        if workers == 1
        else ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("fork"), initializer=torch.set_num_threads, initargs=(1,)
        )
    )
    columns = TextColumn("image cache"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()
    bar = Progress(*columns, transient=True, disable=not sys.stdout.isatty())
    bar.add_task("decode", total=n)
    with text_cache.building(folder) as tmp, pool as executor, bar:
        np.save(tmp / "labels.npy", np.asarray([label for _, label in samples], dtype=np.int64))
        rows = None  # a raw cache: each worker writes its rows into the file itself, no pixels cross a pipe
        if kind == "raw":  # the rows go through plain file handles: no process keeps the whole array resident
            shape = (n, channels, side, side)
            offset = np.lib.format.open_memmap(tmp / "images.npy", mode="w+", dtype=np.uint8, shape=shape).offset
            rows = (str(tmp / "images.npy"), offset)
        lengths: list[int] = []
        with open(tmp / "images.bin", "wb") if kind == "jpeg" else contextlib.nullcontext() as f:
            decode = partial(decode_chunk, meta=meta, rows=rows)
            for (_, paths), blobs in zip(chunks, executor.map(decode, chunks), strict=True):
                if isinstance(blobs, str):
                    raise UserError(f"data.root: cannot read {blobs} as an image")
                if f is not None:
                    f.write(b"".join(blobs))
                    lengths += [len(b) for b in blobs]
                bar.advance(bar.task_ids[0], len(paths))
        size = sum(lengths) if kind == "jpeg" else n * channels * side * side
        if kind == "jpeg":
            np.save(tmp / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        took = time.perf_counter() - began
        (tmp / text_cache.META).write_text(
            json.dumps(
                {
                    "size": n,
                    "shape": [channels, side, side],
                    "format": kind,
                    "quality": QUALITY if kind == "jpeg" else None,
                    "bytes": size,
                    "raw_bytes": raw,
                    "version": VERSION,
                }
            )
        )
    log(
        f"image cache: decoded {n} images to {channels}x{side}x{side} {kind} with {workers} processes in "
        f"{took:.1f} s ({n / max(took, 1e-9):.0f} images/s), {size_text(size)}"
        + (f", {size / raw:.2f}x raw" if kind == "jpeg" else "")
        + f" ({size_text(free)} were free), into {folder}"
    )


def decode_chunk(chunk: tuple[int, list[str]], meta: dict, rows: tuple[str, int] | None = None) -> list[bytes] | str:
    """(index of the first image, paths) -> with `rows` (a raw cache's .npy and its data offset) each row written
    in place as decoded (a stacked 38 MB block a chunk cost a quarter of the decode in page faults), else one
    JPEG a file for the caller. A path that is no image comes back as itself (an exception may not pickle)."""
    (start, paths), (file, first) = chunk, rows or (None, 0)
    steps, mode, blobs = decode_steps(meta), pil_mode(meta), []
    with open(file, "r+b") if file else contextlib.nullcontext() as f:
        for at, path in enumerate(paths, start):
            try:
                with Image.open(path) as img:
                    x = steps(img.convert(mode)).as_subclass(torch.Tensor)
            except (UnidentifiedImageError, OSError):
                return path
            if f is None:
                blobs.append(encode_jpeg(x, quality=QUALITY).numpy().tobytes())
                continue
            pixels = x.contiguous().numpy()  # (C, S, S) uint8
            f.seek(first + at * pixels.nbytes)
            f.write(pixels.data)
    return blobs


def host_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def read_mode(meta: dict) -> ImageReadMode:
    return ImageReadMode.GRAY if pil_mode(meta) == "L" else ImageReadMode.RGB


class EncodedImages:
    """A batch still JPEG-encoded (data.decode=gpu): `.to(device)` decodes it there with nvJPEG in one call and
    runs the validation transform (and any augmentation) on the device."""

    def __init__(self, blobs: list[torch.Tensor], meta: dict, transform, batched: bool) -> None:
        self.blobs, self.meta, self.transform, self.batched = blobs, meta, transform, batched

    def __len__(self) -> int:
        return len(self.blobs)

    def to(self, device, non_blocking: bool = False) -> torch.Tensor:
        images = decode_jpeg(self.blobs, mode=read_mode(self.meta), device=device)
        steps = decode_steps(self.meta)  # per image: files differ in size (a jpeg cache's do not: no resize)
        x = torch.stack([steps(img).as_subclass(torch.Tensor) for img in images])  # (N, C, S, S) uint8
        if self.batched:
            return self.transform(x).as_subclass(torch.Tensor)
        return torch.stack([self.transform(img).as_subclass(torch.Tensor) for img in x])


class CachedImages(Dataset):
    """A complete cache: items (normalised float (C, S, S), label). Whole batches are fetched in one indexing op
    until augmentation is composed into `transform`; `encoded` batches leave as `EncodedImages`. The files
    open lazily, so pickling (DataLoader workers) sends the path, not the pixels."""

    def __init__(self, folder: str | Path, meta: dict, encoded: bool = False) -> None:
        self.folder, self.meta, self.encoded = Path(folder), meta, encoded
        self.format = json.loads((self.folder / text_cache.META).read_text())["format"]
        self.labels = torch.from_numpy(np.load(self.folder / "labels.npy"))
        self.transform = self.batch_transform = on_the_fly(meta)
        self._images: np.ndarray | None = None

    @property
    def images(self) -> np.ndarray:
        if self._images is None and self.format == "raw":
            self._images, self._offsets = np.load(self.folder / "images.npy", mmap_mode="r"), None
        elif self._images is None:
            self._images = np.memmap(self.folder / "images.bin", dtype=np.uint8, mode="r")
            self._offsets = np.load(self.folder / "offsets.npy")
        return self._images

    def blob(self, i: int) -> torch.Tensor:
        """Image i's JPEG bytes (a jpeg cache), copied out of the map."""
        images, offsets = self.images, self._offsets
        assert offsets is not None  # a jpeg cache: loaded with its images
        return torch.from_numpy(np.array(images[offsets[i] : offsets[i + 1]]))

    def pixels(self, at: np.ndarray) -> torch.Tensor:
        """uint8 (N, C, S, S) of the images at `at`: rows of the map, or JPEGs decoded here."""
        if self.format == "raw":
            return torch.from_numpy(self.images[at])  # fancy indexing copies the rows out of the map
        return torch.stack([decode_jpeg(self.blob(i), mode=read_mode(self.meta)) for i in at])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.transform(self.pixels(np.asarray([i]))[0]).as_subclass(torch.Tensor), int(self.labels[i])

    @property
    def batched(self) -> bool:
        """Batches fetched whole, with nothing random drawn here (data.sample_seed)."""
        return self.encoded or self.transform is self.batch_transform

    def __getitems__(self, indices: list[int]):
        batched = self.transform is self.batch_transform
        at = np.asarray(indices, dtype=np.int64)
        labels = self.labels[torch.from_numpy(at)]
        if self.encoded:
            return ImageBatch(EncodedImages([self.blob(i) for i in at], self.meta, self.transform, batched), labels)
        if not batched:
            return [self[i] for i in indices]
        return ImageBatch(self.batch_transform(self.pixels(at)).as_subclass(torch.Tensor), labels)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_images": None}


def cached_folder(cfg, dist, dataset, meta: dict) -> CachedImages:
    """An ImageFolder's samples, decoded once into the cache by the first rank of each node (dist=None: here)."""
    kind, root, files = cfg.data.cache, Path(dataset.root), []
    for path, label in dataset.samples:  # each file's path (relative to the tree), size, mtime and class
        st = os.stat(path)
        files.append((str(Path(path).relative_to(root)), st.st_size, st.st_mtime_ns, int(label)))
    described = {
        "version": VERSION,
        "root": str(root.resolve()),
        "files": files,
        "image_size": meta["image_size"],
        "mode": pil_mode(meta),
        "steps": "to_image,resize(antialias),center_crop",
        "format": kind,
        "quality": QUALITY if kind == "jpeg" else None,
    }
    key = json.dumps(described, sort_keys=True)
    folder = text_cache.cache_root(cfg) / f"images-{hashlib.sha256(key.encode()).hexdigest()[:20]}"
    build = partial(write, folder, dataset.samples, meta, kind, log=partial(print, flush=True))
    text_cache.ensure(dist, folder, build, what="image cache")
    return CachedImages(folder, meta, encoded=cfg.data.decode == "gpu")
