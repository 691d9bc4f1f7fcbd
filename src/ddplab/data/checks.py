"""What the launcher checks of a built-in data source before any worker starts, from the config alone.
No torch here: the launcher imports this module, and the workers import torch once each.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from ddplab.errors import UserError, first_line, size_text
from ddplab.runtime.extras import require

# data.name -> (channels, side) of the images as stored; an image_folder tree's are read from its files.
NATIVE = {"digits": (1, 8), "mnist": (1, 28), "fashion_mnist": (1, 28), "cifar10": (3, 32)}
TORCHVISION = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "cifar10": "CIFAR10"}
FOLDER_SIDE = 64  # side for folder trees whose images differ in size, when neither config nor model sets one
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # ImageFolder's
GREY_MODES = ("1", "L", "LA")  # PIL modes read as one channel (8 bits at most: no clipping)
SIZES_SHOWN = 3  # distinct image sizes a folder's message names


class ImageSpec(NamedTuple):
    """What the images become: channels as stored (and read), channels the model gets, side."""

    source_channels: int
    channels: int
    side: int


def default_root(cfg) -> str:
    return cfg.data.root or "data"


def expected_files(name: str, root: str) -> list[Path]:
    """The files torchvision's loader reads, where it looks for them."""
    if name == "cifar10":
        folder = Path(root) / "cifar-10-batches-py"
        return [folder / f for f in ("batches.meta", *(f"data_batch_{i}" for i in range(1, 6)), "test_batch")]
    raw = Path(root) / TORCHVISION[name] / "raw"
    return [raw / f"{split}-{kind}-ubyte" for split in ("train", "t10k") for kind in ("images-idx3", "labels-idx1")]


def image_spec(
    cfg, channels: int | None = None, side: int | None = None, log: Callable[[str], None] | None = None
) -> ImageSpec:
    """The images for this config, given the model's `channels` and default `side` (None: what the data has).
    `log` hears how an image_folder's side was chosen when neither the config nor the model sets one."""
    if cfg.data.name != "image_folder":
        source, native = NATIVE[cfg.data.name]
        return ImageSpec(source, channels or source, cfg.data.image_size or side or native)
    grey, sizes = folder_images(cfg.data.root) if cfg.data.root else (False, ())
    source = 1 if grey and sizes else 3
    side = cfg.data.image_size or side
    if side is None:
        # One shared size is kept (a non-square one as its shorter side, centre-cropped); mixed sizes get
        # FOLDER_SIDE, since any one image's size would be arbitrary.
        side = FOLDER_SIDE
        if not sizes:
            why = f"no readable images: {FOLDER_SIDE}x{FOLDER_SIDE}"
        elif len(sizes) == 1:
            ((w, h),) = sizes
            side = min(w, h)
            how = f"resized to {side} on the shorter side and centre-cropped to" if w != h else "kept at"
            why = f"every image is {w}x{h}: {how} {side}x{side}"
        else:
            shown = ", ".join(f"{w}x{h}" for w, h in sizes) + (", ..." if len(sizes) == SIZES_SHOWN else "")
            why = (
                f"images differ in size ({shown}): resized and centre-cropped to "
                f"{FOLDER_SIDE}x{FOLDER_SIDE}; set data.image_size to choose"
            )
        if cfg.data.stream:
            why = (
                f"streamed shards are not read ahead: resized and centre-cropped to {side}x{side}; set data.image_size"
            )
        if log is not None:
            log(why)
    return ImageSpec(source, channels or source, side)


def folder_images(root: str) -> tuple[bool, tuple]:
    """(every image is grey, the first distinct (width, height) pairs seen, at most SIZES_SHOWN) under `root`, from
    the file headers, until they are known to differ in size and hold colour. An unreadable file is skipped here and
    named when it is decoded."""
    from PIL import Image  # only for image_folder: the launcher checks other configs without it

    grey = True
    sizes: list[tuple[int, int]] = []
    for folder, dirs, files in os.walk(root, followlinks=True):
        dirs.sort()
        for name in sorted(files):
            if not name.lower().endswith(IMAGE_EXTENSIONS):
                continue
            try:
                with Image.open(os.path.join(folder, name)) as img:
                    mode, size = img.mode, img.size
            except (OSError, SyntaxError, ValueError):
                continue
            grey = grey and mode in GREY_MODES
            if size not in sizes and len(sizes) < SIZES_SHOWN:
                sizes.append(size)
            if len(sizes) > 1 and not grey:
                return grey, tuple(sizes)
    return grey, tuple(sizes)


def check_images(cfg) -> None:
    """From the config alone (whether the images fit the model is the registry's check)."""
    if cfg.data.name == "image_folder" and cfg.data.root is None and not cfg.data.stream:
        raise UserError(
            "data.root: image_folder needs data.root=<folder with one sub-folder per class, "
            "or train/ and val/ holding them>"
        )


def check_image_files(cfg) -> None:
    """Before launch: the files torchvision reads are where it looks; folder trees have 2+ classes."""
    name = cfg.data.name
    if name in TORCHVISION:
        root = default_root(cfg)
        missing = [p for p in expected_files(name, root) if not p.is_file()]
        if missing and not cfg.data.download:
            where = "no such folder" if not Path(root).is_dir() else f"{missing[0].name} missing"
            names = ", ".join(p.name for p in expected_files(name, root))
            raise UserError(
                f"data.root: {TORCHVISION[name]} not found under {root} ({where}): put {names} "
                f"in {missing[0].parent} (uncompressed), or set data.download=true"
            )
    elif name == "image_folder":
        folder = Path(cfg.data.root)
        if not folder.is_dir():
            raise UserError(f"data.root: no such folder: {folder}")
        for split in folder_layout(folder).values():
            if split is not None:
                classes = sorted(p.name for p in split.iterdir() if p.is_dir() and not p.name.startswith("."))
                if len(classes) < 2:
                    raise UserError(
                        f"data.root: {split} holds {len(classes)} class folder(s) "
                        f"({', '.join(classes) or 'none'}); image_folder needs at least 2, one per class"
                    )


def folder_layout(root: Path) -> dict[str, Path | None]:
    """`train/` (+ optional `val/`, `test/`), or one tree whose sub-folders are the classes."""
    if (root / "train").is_dir():
        return {s: (root / s if (root / s).is_dir() else None) for s in ("train", "val", "test")}
    return {"train": root, "val": None, "test": None}


def check_corpus(cfg) -> None:
    """data.name=text: a named corpus exists."""
    if cfg.data.path is not None and not Path(cfg.data.path).exists():
        raise UserError(f"data.path: no such file or folder: {cfg.data.path}")


# model.name -> the tokenizer it reads, when data.tokenizer is not set
DEFAULT_TOKENIZER = {"transformer": "hash", "hf": "hf"}


def tokenizer_kind(cfg) -> str:
    return cfg.data.tokenizer or DEFAULT_TOKENIZER.get(cfg.model.name, "hash")


def check_text_classes(cfg) -> None:
    """Text classification: the model reads what the tokenizer makes."""
    d, m = cfg.data, cfg.model
    kind = tokenizer_kind(cfg)
    if kind not in ("hash", "hf"):
        raise UserError(f"data.tokenizer={kind} does not fit data.name={d.name}; use hash or hf")
    if m.name in DEFAULT_TOKENIZER and kind != DEFAULT_TOKENIZER[m.name]:
        wanted = DEFAULT_TOKENIZER[m.name]
        raise UserError(
            f"data.tokenizer={kind} does not fit model.name={m.name}, which reads "
            f"{'its own pretrained tokenizer' if wanted == 'hf' else 'hash token ids'}: "
            f"use data.tokenizer={wanted} (or leave it unset)"
        )
    if d.name == "synthetic_reviews":
        from ddplab.data import text_sources  # numpy: kept off every command's start

        k = d.num_classes or 2
        if not 2 <= k <= len(text_sources.NEGATIVE + text_sources.POSITIVE + text_sources.EXTRA) // 3:
            raise UserError(f"data.num_classes={k}: synthetic_reviews makes 2 to 18 classes")
    if d.name == "text_files" and not d.stream:
        from ddplab.data import text_sources  # numpy: only for this source

        text_sources.check_files(cfg)


# data.name -> the shard formats (ddplab.data.shard_files) it streams with data.stream=true
STREAMS = {
    "text": ("text", "json", "parquet", "arrow"),
    "text_files": ("parquet", "arrow", "json"),
    "image_folder": ("tar",),
}


def check_stream(cfg) -> None:
    """data.stream=true: a source that streams, data.train set, nothing to learn from the whole data set."""
    d = cfg.data
    if not d.stream:
        return
    if d.name not in STREAMS:
        raise UserError(
            f"data.stream=true streams data.name {', '.join(STREAMS)} from shards; data.name={d.name} is read "
            f"whole (a data function of your own returns ddplab.Shards itself)"
        )
    require("text", "data.stream=true", ("fsspec", "pyarrow"))
    for field in ("path", "root"):
        if getattr(d, field) is not None:
            raise UserError(
                f"data.{field}: data.stream=true reads data.train, data.val and data.test; "
                f"give data.train={getattr(d, field)} instead"
            )
    if d.train is None:
        raise UserError(
            f"data.stream=true needs data.train=<shards: a file, folder, glob or fsspec URL> "
            f"({', '.join(STREAMS[d.name])}); data.val and data.test are optional"
        )
    if d.name == "text" and d.tokenizer not in (None, "byte"):
        raise UserError(
            f"data.tokenizer={d.tokenizer} with data.stream=true: a character vocabulary is learned from the "
            f"whole corpus, which a stream never holds; use data.tokenizer=byte (the default when streaming)"
        )
    if d.name == "image_folder" and d.num_classes is None:
        raise UserError(
            "data.name=image_folder with data.stream=true needs data.num_classes: the classes (each sample's "
            ".cls, 0 .. num_classes-1) are not read ahead of training"
        )
    if d.name == "image_folder" and d.decode == "gpu":
        raise UserError("data.decode=gpu with data.stream=true: streamed images are decoded in the loader workers")


def check_stream_files(cfg) -> None:
    """Before launch: each split's path names shard files, all of one format the source streams."""
    from ddplab.data.shard_files import expand, format_of  # fsspec: only for a streamed source

    d = cfg.data
    for split in ("train", "val", "test"):
        path = getattr(d, split)
        if path is None:
            continue
        try:
            files = expand(path, None, {})
            present = bool(files) and files[0][0].exists(files[0][1])
        except Exception as exc:  # noqa: BLE001 - a store refusing, a credential missing: it is the path's
            raise UserError(f"data.{split}: cannot list {path}: {first_line(exc, 160) or type(exc).__name__}") from None
        if not present:
            raise UserError(f"data.{split}: no shard files at {path}")
        formats = sorted({format_of(p) or os.path.splitext(p)[1] or p for _, p in files})
        if len(formats) > 1 or formats[0] not in STREAMS[d.name]:
            raise UserError(
                f"data.{split}: data.name={d.name} streams {', '.join(STREAMS[d.name])} shards; "
                f"{path} holds {' and '.join(formats)} files"
            )


FLOAT32, INT64 = 4, 8  # bytes a value


def largest_tensors(cfg) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(field, what it is, shape, bytes a value) of the tensors a config field sizes, so that one that cannot fit
    is caught before anything is allocated (a hash vocabulary of 10^12 asked torch for 64 TB, after the run
    folder existed)."""
    d, m, t = cfg.data, cfg.model, cfg.training
    found: list[tuple[str, str, tuple[int, ...], int]] = []
    if m.name in ("transformer", "gpt"):
        if m.name == "transformer" and tokenizer_kind(cfg) == "hash":
            found.append(("data.vocab_size", "the token embedding table", (d.vocab_size, m.dim), FLOAT32))
        length = ("data.max_len", d.max_len) if m.name == "transformer" else ("model.context", m.context)
        found.append((length[0], "the positional encoding", (length[1], m.dim), FLOAT32))
        found.append(("model.dim", "a feed-forward weight", (m.dim, m.ff_dim or 4 * m.dim), FLOAT32))
        found.append(
            (length[0], "one layer's attention scores", (t.batch_size, m.heads, length[1], length[1]), FLOAT32)
        )
        if d.num_classes and m.name == "transformer":
            found.append(("data.num_classes", "the classifier's output layer", (d.num_classes, m.dim), FLOAT32))
    if d.image_size is not None:
        found.append(("data.image_size", "a batch of images", (t.batch_size, 3, d.image_size, d.image_size), FLOAT32))
    if d.name == "synthetic" and m.name == "gpt":
        found.append(("data.num_samples", "the generated sequences", (d.num_samples, m.context + 1), INT64))
    elif d.name == "synthetic":
        side, classes = d.image_size or 28, d.num_classes or 10
        found.append(("data.num_classes", "the generated class patterns", (classes, 3, side, side), FLOAT32))
        found.append(("data.num_samples", "the generated images", (d.num_samples, 3, side, side), FLOAT32))
    return found


def check_memory(cfg) -> None:
    """Counts and shapes the config sets (vocabulary, classes, lengths, image sides, samples) fit this machine's
    memory: one line naming the field, the tensor and the bytes it needs, and exit 2, before anything is
    allocated. (A model that fits the host is moved to a GPU later; one that does not fit the host is never built.)"""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # the OS does not say
        return
    for field, what, shape, itemsize in largest_tensors(cfg):
        need = math.prod(shape) * itemsize
        if need > total:
            value = field.split(".")[-1]
            section = getattr(cfg, field.split(".")[0])
            raise UserError(
                f"{field}={getattr(section, value)}: {what} ({' x '.join(map(str, shape))} values) needs "
                f"{size_text(need)}; this machine has {size_text(total)} of memory"
            )
