"""Image classification data: torchvision's MNIST / FashionMNIST / CIFAR-10, any ImageFolder
tree, and scikit-learn's 8x8 handwritten digits (shipped with scikit-learn, so always offline).

Every split yields `(image (C, S, S) float tensor, label)`. Images stay uint8 (or files on
disk) until an item is read, and go through one transform pipeline built from the bundle's
`meta`, the same dict the checkpoint stores, so `ddplab predict` applies exactly the
validation transforms.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from ddplab.data.bundle import DataBundle
from ddplab.data.checks import TORCHVISION, default_root, expected_files, folder_layout, image_spec
from ddplab.errors import UserError

# Per-channel mean / std of the training images in [0, 1]; ImageNet's for folder trees,
# because that is what pretrained torchvision weights expect. Digits are measured at build.
STATS = {
    "mnist": ([0.1307], [0.3081]),
    "fashion_mnist": ([0.2860], [0.3530]),
    "cifar10": ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]),
    "image_folder": ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
}
PRECOMPUTE_BYTES = 512 * 2**20  # transformed tensor sets up to this size are built once, not per item


# ---------------------------------------------------------------------------- transforms

def transform(meta: dict):
    """The validation transform: uint8 tensor(s) or a PIL image -> normalised float (C, S, S)."""
    from torchvision.transforms import v2

    side = meta["image_size"]
    steps = [v2.ToImage(), v2.Resize(side, antialias=True), v2.CenterCrop(side)]
    if meta["channels"] == 3:
        steps.append(v2.RGB())  # grey images repeated into 3 channels for RGB models
    steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(meta["mean"], meta["std"])]
    return v2.Compose(steps)


def augmentation(meta: dict):
    """Training only, after the validation transform: random crop (reflect-padded) + horizontal flip."""
    from torchvision.transforms import v2

    side = meta["image_size"]
    return v2.Compose([v2.RandomCrop(side, padding=max(side // 8, 1), padding_mode="reflect"),
                       v2.RandomHorizontalFlip()])


def encode_images(meta: dict, items: list[str]) -> torch.Tensor:
    """`ddplab predict`: image files -> the batch validation would have built."""
    from PIL import Image, UnidentifiedImageError

    tf = transform(meta)
    mode = "L" if meta["source_channels"] == 1 else "RGB"
    batch = []
    for item in items:
        if not Path(item).is_file():
            raise UserError(f"no such image file: {item}")
        try:
            with Image.open(item) as img:
                batch.append(tf(img.convert(mode)))
        except (UnidentifiedImageError, OSError):
            raise UserError(f"cannot read {item} as an image") from None
    return torch.stack(batch)


class ImageBatch(NamedTuple):
    """A batch fetched whole: (N, C, H, W) images and their (N,) int64 labels."""

    images: torch.Tensor
    labels: torch.Tensor


class ImageTensors(Dataset):
    """Images (N, C, H, W) and integer labels; `transform` (if any) runs item by item."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform=None) -> None:
        self.images, self.labels, self.transform = images, labels.long(), transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        x = self.images[i]
        return (self.transform(x) if self.transform is not None else x), int(self.labels[i])

    def __getitems__(self, indices: list[int]):
        """A batch in two indexing ops, not two per item: the DataLoader asks for this when it
        exists, and for a small model's step the per-item calls cost more than the step.
        Without a transform the batch comes already stacked, for `stack_images` to pass on."""
        if self.transform is not None:
            return [self[i] for i in indices]
        at = torch.from_numpy(np.asarray(indices, dtype=np.int64))  # a quarter of torch.as_tensor's time
        return ImageBatch(self.images[at], self.labels[at])


def image_tensors(images: torch.Tensor, labels: torch.Tensor, meta: dict) -> ImageTensors:
    """uint8 images under the validation transform: applied once to the whole set when the result
    is small (a per-item transform costs more than a small model's step), else item by item."""
    tf = transform(meta)
    c, side = meta["channels"], meta["image_size"]
    if len(images) * c * side * side * 4 <= PRECOMPUTE_BYTES:
        return ImageTensors(torch.cat([tf(chunk) for chunk in images.split(4096)]), labels)
    return ImageTensors(images, labels, tf)


def split_indices(n: int, val_fraction: float, test_fraction: float, seed: int) -> tuple[list, list, list]:
    """Seeded shuffle, then test | val | train."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_test, n_val = round(n * test_fraction), round(n * val_fraction)
    if n_test + n_val >= n:
        raise UserError(f"data.val_fraction + data.test_fraction leave no training images ({n} in all)")
    return order[n_test + n_val:], order[n_test:n_test + n_val], order[:n_test]


def _meta(cfg, label_names: list[str], mean: list[float], std: list[float]) -> dict:
    source_channels, channels, side = image_spec(cfg)
    if channels != len(mean):  # grey statistics serve each of the repeated channels
        mean, std = mean * channels, std * channels
    return {"input": "image", "label_names": label_names, "image_size": side, "channels": channels,
            "source_channels": source_channels, "mean": [float(m) for m in mean], "std": [float(s) for s in std],
            "input_shape": [channels, side, side]}


def stack_images(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(image, label) pairs -> (images, labels): what default_collate returns, without its
    per-batch type dispatch; a batch fetched whole (`ImageBatch`) passes straight through."""
    if isinstance(batch, ImageBatch):
        return batch.images, batch.labels
    images, labels = zip(*batch)
    return torch.stack(images), torch.tensor(labels)


def _bundle(cfg, meta: dict, train, val, test) -> DataBundle:
    """`train`, `val`, `test`: datasets under the validation transform; training adds augmentation."""
    train_view = _augmented(train, augmentation(meta)) if cfg.data.augment else train
    return DataBundle(task="classification", train=train_view, val=_non_empty(val), test=_non_empty(test),
                      num_classes=len(meta["label_names"]), meta=meta, input_shape=tuple(meta["input_shape"]),
                      collate_fn=stack_images)


def _non_empty(dataset):
    return dataset if dataset is not None and len(dataset) else None


def _augmented(dataset, augment):
    """The same samples (shared storage, shallow copy) with `augment` after their transform."""
    from torchvision.transforms import v2

    if isinstance(dataset, Subset):
        return Subset(_augmented(dataset.dataset, augment), dataset.indices)
    view = copy.copy(dataset)
    view.transform = augment if dataset.transform is None else v2.Compose([dataset.transform, augment])
    return view


# ---------------------------------------------------------------------------- builders

def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits: (N, 8, 8) ink levels 0..16 and (N,) labels.

    Read from the CSV file scikit-learn ships, as its `load_digits` reads it, without importing
    scikit-learn (about a second of every run's start-up); through `load_digits` where the file
    is not found."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is not None and path.is_file():
        table = np.loadtxt(path, delimiter=",")
        return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    return digits.images, digits.target


def build_digits(cfg, ctx) -> DataBundle:
    ink, target = load_digits()
    # 0..16 ink levels as 8-bit grey, the form a PNG of a digit takes at predict time.
    images = torch.from_numpy(np.rint(ink * 255 / 16).astype(np.uint8)).unsqueeze(1)
    labels = torch.from_numpy(target).long()
    train, val, test = split_indices(len(labels), cfg.data.val_fraction, cfg.data.test_fraction, cfg.experiment.seed)
    pixels = images[train].float() / 255
    meta = _meta(cfg, [str(i) for i in range(10)], [pixels.mean().item()], [pixels.std().item()])
    data = image_tensors(images, labels, meta)
    return _bundle(cfg, meta, Subset(data, train), Subset(data, val), Subset(data, test))


def build_torchvision(cfg, ctx) -> DataBundle:
    import torchvision

    cls = getattr(torchvision.datasets, TORCHVISION[cfg.data.name])
    root = default_root(cfg)
    if cfg.data.download:
        if ctx.is_main:  # one process downloads while the others wait
            for train in (True, False):
                cls(root, train=train, download=True)
        ctx.barrier()
    try:
        sets = [cls(root, train=train) for train in (True, False)]
    except RuntimeError:
        raise UserError(f"data.root: {TORCHVISION[cfg.data.name]} not found under {root} "
                        f"(expected {expected_files(cfg.data.name, root)[0]}); set data.download=true") from None
    tensors = []
    for s in sets:
        images = torch.as_tensor(s.data)
        images = images.unsqueeze(1) if images.dim() == 3 else images.permute(0, 3, 1, 2)  # (N, C, H, W)
        tensors.append((images.contiguous(), torch.as_tensor(s.targets).long()))
    meta = _meta(cfg, list(sets[0].classes), *STATS[cfg.data.name])
    data = image_tensors(*tensors[0], meta)
    train, val, _ = split_indices(len(data), cfg.data.val_fraction, 0.0, cfg.experiment.seed)
    return _bundle(cfg, meta, Subset(data, train), Subset(data, val), image_tensors(*tensors[1], meta))


def read_image(path: str):
    """torchvision's loader, with a corrupt or unreadable file named in one line (found mid-training)."""
    from PIL import Image

    try:
        with open(path, "rb") as f, Image.open(f) as img:
            return img.convert("RGB")
    except (OSError, SyntaxError, ValueError) as err:  # PIL's UnidentifiedImageError is an OSError
        raise UserError(f"cannot read image {path}: {err}") from None


def build_image_folder(cfg, ctx) -> DataBundle:
    from torchvision.datasets import ImageFolder

    layout = folder_layout(Path(cfg.data.root))

    def read(path: Path) -> ImageFolder:
        try:
            return ImageFolder(str(path), loader=read_image)
        except FileNotFoundError as exc:  # a class folder without images
            raise UserError(f"data.root: {str(exc).splitlines()[0]}") from None

    full = read(layout["train"])
    fixed = {s: read(layout[s]) for s in ("val", "test") if layout[s] is not None}
    for split, ds in fixed.items():
        if ds.classes != full.classes:
            raise UserError(f"data.root: {layout[split]} has classes {ds.classes[:5]}..., "
                            f"{layout['train']} has {full.classes[:5]}...; both need the same class folders")
    val_fraction = 0.0 if "val" in fixed else cfg.data.val_fraction
    test_fraction = 0.0 if "test" in fixed else cfg.data.test_fraction
    train, val, test = split_indices(len(full), val_fraction, test_fraction, cfg.experiment.seed)
    meta = _meta(cfg, list(full.classes), *STATS["image_folder"])
    if cfg.data.cache:  # decoded once into a memory-mapped uint8 array shared by the node's ranks
        from ddplab.data import image_cache

        full = image_cache.cached_folder(cfg, ctx, full, meta)
        fixed = {s: image_cache.cached_folder(cfg, ctx, ds, meta) for s, ds in fixed.items()}
    else:
        tf = transform(meta)
        full.transform = tf
        for ds in fixed.values():
            ds.transform = tf
    val_set = fixed.get("val", Subset(full, val))
    test_set = fixed.get("test", Subset(full, test))
    return _bundle(cfg, meta, Subset(full, train), val_set, test_set)
