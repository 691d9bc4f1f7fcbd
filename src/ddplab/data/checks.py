"""What the launcher checks of a built-in data source before any worker starts: names, files
and image sizes from the config alone. No torch here: `ddplab train` imports this module in the
launcher, and the workers import torch once each.
"""

from __future__ import annotations

from pathlib import Path

from ddplab.errors import UserError

# data.name -> (channels, side) of the images as stored; image_folder trees have no fixed side.
NATIVE = {"digits": (1, 8), "mnist": (1, 28), "fashion_mnist": (1, 28), "cifar10": (3, 32), "image_folder": (3, None)}
TORCHVISION = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "cifar10": "CIFAR10"}
FOLDER_SIDE = 64  # default side for folder trees when the model has no preferred one


# ---------------------------------------------------------------------------- images

def default_root(cfg) -> str:
    return cfg.data.root or "data"


def expected_files(name: str, root: str) -> list[Path]:
    """The files torchvision's loader reads, where it looks for them."""
    if name == "cifar10":
        folder = Path(root) / "cifar-10-batches-py"
        return [folder / f for f in ("batches.meta", *(f"data_batch_{i}" for i in range(1, 6)), "test_batch")]
    raw = Path(root) / TORCHVISION[name] / "raw"
    return [raw / f"{split}-{kind}-ubyte" for split in ("train", "t10k") for kind in ("images-idx3", "labels-idx1")]


def image_spec(cfg) -> tuple[int, int, int]:
    """(channels as stored, channels the model gets, image side) for this config."""
    from ddplab.registry import image_needs

    native_channels, native_side = NATIVE[cfg.data.name]
    channels, model_side = image_needs(cfg.model.name)
    side = cfg.data.image_size or model_side or native_side or FOLDER_SIDE
    return native_channels, channels or native_channels, side


def check_images(cfg) -> None:
    """From the config alone (whether the images fit the model is the registry's check)."""
    if cfg.data.name == "image_folder" and cfg.data.root is None:
        raise UserError("data.root: image_folder needs data.root=<folder with one sub-folder per class, "
                        "or train/ and val/ holding them>")


def check_image_files(cfg) -> None:
    """Before launch: the files torchvision reads are where it looks; folder trees have 2+ classes."""
    name = cfg.data.name
    if name in TORCHVISION:
        root = default_root(cfg)
        missing = [p for p in expected_files(name, root) if not p.is_file()]
        if missing and not cfg.data.download:
            where = "no such folder" if not Path(root).is_dir() else f"{missing[0].name} missing"
            names = ", ".join(p.name for p in expected_files(name, root))
            raise UserError(f"data.root: {TORCHVISION[name]} not found under {root} ({where}): put {names} "
                            f"in {missing[0].parent} (uncompressed), or set data.download=true")
    elif name == "image_folder":
        root = Path(cfg.data.root)
        if not root.is_dir():
            raise UserError(f"data.root: no such folder: {root}")
        for split in folder_layout(root).values():
            if split is not None:
                classes = class_folders(split)
                if len(classes) < 2:
                    raise UserError(f"data.root: {split} holds {len(classes)} class folder(s) "
                                    f"({', '.join(classes) or 'none'}); image_folder needs at least 2, one per class")


def folder_layout(root: Path) -> dict[str, Path | None]:
    """`train/` (+ optional `val/`, `test/`), or one tree whose sub-folders are the classes."""
    if (root / "train").is_dir():
        return {s: (root / s if (root / s).is_dir() else None) for s in ("train", "val", "test")}
    return {"train": root, "val": None, "test": None}


def class_folders(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))


# ---------------------------------------------------------------------------- text

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
        raise UserError(f"data.tokenizer={kind} does not fit model.name={m.name}, which reads "
                        f"{'its own pretrained tokenizer' if wanted == 'hf' else 'hash token ids'}: "
                        f"use data.tokenizer={wanted} (or leave it unset)")
    if d.name == "synthetic_reviews":
        from ddplab.data import text_synthetic

        k = d.num_classes or 2
        if not 2 <= k <= len(text_synthetic.NEGATIVE + text_synthetic.POSITIVE + text_synthetic.EXTRA) // 3:
            raise UserError(f"data.num_classes={k}: synthetic_reviews makes 2 to 18 classes")
    if d.name == "text_files":
        from ddplab.data import text_sources

        text_sources.check_files(cfg)
