"""Image classification, a workload file like any user's: torchvision's MNIST / FashionMNIST / CIFAR-10, ImageFolder
trees, WebDataset tar shards (data.stream) and scikit-learn's 8x8 digits (always offline). The images keep their own
channels and size unless the model needs others: torchvision classifiers get RGB at data.image_size, else 224.

Splits yield `(image (C, S, S) float, label)` through one transform built from `meta`, the dict the checkpoint
stores, so `ddplab predict` applies exactly the validation transforms.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image
from torch.utils.data import Dataset, Subset
from torchvision.datasets.folder import IMG_EXTENSIONS, ImageFolder
from torchvision.transforms import v2

import ddplab
from ddplab.data import image_cache, shards
from ddplab.data.checks import TORCHVISION, ImageSpec, default_root, expected_files, folder_layout, image_spec
from ddplab.data.image_cache import ImageBatch, decode_steps, on_the_fly, pil_mode
from ddplab.errors import UserError
from ddplab.models import vision as models
from ddplab.registry import image_needs

# Per-channel mean / std of the training images in [0, 1]. Folder trees get ImageNet's, since
# pretrained torchvision weights expect them (grey: their mean over the channels); digits are
# measured at build.
STATS = {
    "mnist": ([0.1307], [0.3081]),
    "fashion_mnist": ([0.2860], [0.3530]),
    "cifar10": ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]),
}
FOLDER_STATS = {3: ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]), 1: ([0.449], [0.226])}
PRECOMPUTE_BYTES = 512 * 2**20  # transformed tensor sets up to this size are built once, not per item


# (train, val, test) under the validation transform (training's augmented with data.augment) and the meta.
ImageSplits = tuple[Dataset, Dataset | None, Dataset | None, dict]


def transform(meta: dict):
    """The validation transform: uint8 tensor(s) or a PIL image -> normalised float (C, S, S)."""
    return v2.Compose([decode_steps(meta), on_the_fly(meta)])


def augmentation(meta: dict):
    """Training only, after the validation transform."""
    side = meta["image_size"]
    return v2.Compose(
        [v2.RandomCrop(side, padding=max(side // 8, 1), padding_mode="reflect"), v2.RandomHorizontalFlip()]
    )


def read_image(path: str, mode: str = "RGB"):
    """torchvision's loader, in `mode`, with an unreadable file named in one line (mid-training or at predict)."""
    try:
        with open(path, "rb") as f, Image.open(f) as img:
            return img.convert(mode)
    except (OSError, SyntaxError, ValueError) as err:  # PIL's UnidentifiedImageError is an OSError
        raise UserError(f"cannot read image {path}: {err}") from None


class ImageFile:
    """`Data.preprocess` for images: a file path -> the tensor validation gives the same image."""

    def __init__(self, meta: dict) -> None:
        self.meta, self.transform = meta, transform(meta)

    def __call__(self, path: str) -> torch.Tensor:
        return self.transform(read_image(path, pil_mode(self.meta))).as_subclass(torch.Tensor)


def image_meta(spec: ImageSpec, label_names: list[str], mean: list[float], std: list[float]) -> dict:
    """What a checkpoint keeps to rebuild the transform and name the labels."""
    if spec.channels != len(mean):  # grey statistics serve each of the repeated channels
        mean, std = mean * spec.channels, std * spec.channels
    return {
        "input": "image",
        "label_names": label_names,
        "image_size": spec.side,
        "channels": spec.channels,
        "source_channels": spec.source_channels,
        "mean": [float(m) for m in mean],
        "std": [float(s) for s in std],
        "input_shape": [spec.channels, spec.side, spec.side],
    }


class ImageTensors(image_cache.CachedImages):
    """Images (N, C, H, W) held in memory and integer labels; `transform` (if any) runs item by item."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform=None) -> None:
        self.tensors, self.labels, self.meta, self.encoded = images, labels.long(), {}, False
        self.batch_transform = torch.nn.Identity()  # batches leave as they are held
        self.transform = self.batch_transform if transform is None else transform

    def pixels(self, at: np.ndarray) -> torch.Tensor:
        return self.tensors[torch.from_numpy(at)]


class EncodedFiles(image_cache.CachedImages):
    """An ImageFolder's JPEG files as bytes (data.decode=gpu, data.cache=false): batches leave as `EncodedImages`."""

    def __init__(self, folder: ImageFolder, meta: dict) -> None:
        other = next((p for p, _ in folder.samples if Path(p).suffix.lower() not in (".jpg", ".jpeg")), None)
        if other is not None:
            raise UserError(
                f"data.decode=gpu decodes JPEG files only, and {other} is not one; set "
                f"data.cache=jpeg (the tree re-encoded once) or data.decode=cpu"
            )
        self.samples, self.meta, self.encoded = folder.samples, meta, True
        self.labels = torch.tensor([label for _, label in folder.samples])
        self.transform = self.batch_transform = on_the_fly(meta)

    def blob(self, i: int) -> torch.Tensor:
        return torchvision.io.read_file(self.samples[i][0])

    def __getitem__(self, i: int):
        x, y = self.__getitems__([i])
        return x.to("cpu")[0], int(y[0])


class TarImages:
    """data.stream: a WebDataset sample ({"__key__": ..., "jpg" | "png" | ...: bytes, "cls": b"3"}) -> (image, id)."""

    def __init__(self, meta: dict, classes: int, augment: bool = False) -> None:
        self.mode, self.classes = pil_mode(meta), classes
        self.transform = v2.Compose([transform(meta), augmentation(meta)]) if augment else transform(meta)

    def __call__(self, sample: dict) -> tuple[torch.Tensor, int]:
        key = sample["__key__"]
        ext = next((e for e in sample if f".{e.lower()}" in IMG_EXTENSIONS), None)
        if ext is None or "cls" not in sample:
            has = ", ".join(f".{e}" for e in sample if e != "__key__")
            raise ValueError(f"shard sample {key} holds {has}: an image sample needs an image file and a .cls")
        label = int(sample["cls"])
        if not 0 <= label < self.classes:
            raise ValueError(
                f"shard sample {key}: class {label} is not one of 0..{self.classes - 1} (data.num_classes)"
            )
        try:
            with Image.open(io.BytesIO(sample[ext])) as img:
                image = img.convert(self.mode)
        except (OSError, SyntaxError, ValueError) as err:
            raise ValueError(f"cannot read image {key}.{ext}: {err}") from None
        return self.transform(image).as_subclass(torch.Tensor), label


def image_tensors(images: torch.Tensor, labels: torch.Tensor, meta: dict) -> ImageTensors:
    """uint8 images under the validation transform: applied once to the whole set when the result
    is small (a per-item transform costs more than a small model's step), else item by item."""
    tf = transform(meta)
    if len(images) * meta["channels"] * meta["image_size"] ** 2 * 4 <= PRECOMPUTE_BYTES:
        return ImageTensors(torch.cat([tf(chunk).as_subclass(torch.Tensor) for chunk in images.split(4096)]), labels)
    return ImageTensors(images, labels, tf)


def split_indices(n: int, val_fraction: float, test_fraction: float, seed: int) -> tuple[list, list, list]:
    """Seeded shuffle, then test | val | train."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_test, n_val = round(n * test_fraction), round(n * val_fraction)
    if n_test + n_val >= n:
        raise UserError(f"data.val_fraction + data.test_fraction leave no training images ({n} in all)")
    return order[n_test + n_val :], order[n_test : n_test + n_val], order[:n_test]


def stack_images(batch) -> tuple[torch.Tensor | image_cache.EncodedImages, torch.Tensor]:
    """default_collate without its per-batch type dispatch; an `ImageBatch` passes straight through."""
    if isinstance(batch, ImageBatch):
        return batch.images, batch.labels
    images, labels = zip(*batch, strict=True)
    return torch.stack(images), torch.tensor(labels)


def _splits(cfg, meta: dict, train, val, test) -> ImageSplits:
    train_view = _augmented(train, augmentation(meta)) if cfg.data.augment else train
    val, test = (s if s is not None and len(s) else None for s in (val, test))
    return train_view, val, test, meta


def _augmented(dataset, augment):
    """The same samples (shared storage, shallow copy) with `augment` after their transform."""
    if isinstance(dataset, Subset):
        return Subset(_augmented(dataset.dataset, augment), dataset.indices)
    view = copy.copy(dataset)
    view.transform = v2.Compose([dataset.transform, augment])
    return view


def digits(cfg, dist, spec: ImageSpec) -> ImageSplits:
    """scikit-learn's 1,797 digits, 8x8 ink levels 0..16, read from the CSV it ships without importing scikit-learn
    (a second of every run's start-up) unless the file is not found."""
    found = importlib.util.find_spec("sklearn")
    path = Path(found.origin).parent / "datasets" / "data" / "digits.csv.gz" if found and found.origin else None
    if path is not None and path.is_file():
        table = np.loadtxt(path, delimiter=",")
        ink, target = table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(np.int64)
    else:
        from sklearn.datasets import load_digits  # the slow import, only where the file is missing

        ink, target = load_digits(return_X_y=True)
        ink = ink.reshape(-1, 8, 8)
    # 0..16 ink levels as 8-bit grey, the form a PNG of a digit takes at predict time.
    images = torch.from_numpy(np.rint(ink * 255 / 16).astype(np.uint8)).unsqueeze(1)
    labels = torch.from_numpy(target).long()
    train, val, test = split_indices(len(labels), cfg.data.val_fraction, cfg.data.test_fraction, cfg.experiment.seed)
    pixels = images[train].float() / 255
    meta = image_meta(spec, [str(i) for i in range(10)], [pixels.mean().item()], [pixels.std().item()])
    data = image_tensors(images, labels, meta)
    return _splits(cfg, meta, Subset(data, train), Subset(data, val), Subset(data, test))


def torchvision_set(cfg, dist, spec: ImageSpec) -> ImageSplits:
    """MNIST, FashionMNIST or CIFAR-10 from torchvision's files (downloaded by one rank if asked)."""
    cls = getattr(torchvision.datasets, TORCHVISION[cfg.data.name])
    root = default_root(cfg)
    if cfg.data.download:
        if dist is None or dist.is_main:  # one process downloads while the others wait
            for is_train in (True, False):
                cls(root, train=is_train, download=True)
        if dist is not None:
            dist.barrier()
    try:
        sets = [cls(root, train=is_train) for is_train in (True, False)]
    except RuntimeError:
        raise UserError(
            f"data.root: {TORCHVISION[cfg.data.name]} not found under {root} "
            f"(expected {expected_files(cfg.data.name, root)[0]}); set data.download=true"
        ) from None
    tensors = []
    for s in sets:
        images = torch.as_tensor(s.data)
        images = images.unsqueeze(1) if images.dim() == 3 else images.permute(0, 3, 1, 2)  # (N, C, H, W)
        tensors.append((images.contiguous(), torch.as_tensor(s.targets).long()))
    meta = image_meta(spec, list(sets[0].classes), *STATS[cfg.data.name])
    data = image_tensors(*tensors[0], meta)
    train, val, _ = split_indices(len(data), cfg.data.val_fraction, 0.0, cfg.experiment.seed)
    return _splits(cfg, meta, Subset(data, train), Subset(data, val), image_tensors(*tensors[1], meta))


def image_folder(cfg, dist, spec: ImageSpec) -> ImageSplits:
    """train/ (+ val/, test/) or one tree split by seed; decoded once (data.cache=raw|jpeg) or every epoch."""
    if cfg.data.stream:  # tar shards decoded as read; the classes are data.num_classes, not read ahead
        k = cfg.data.num_classes
        meta = image_meta(spec, [str(i) for i in range(k)], *FOLDER_STATS[spec.channels])
        streams = shards.split_shards(cfg, TarImages(meta, k))
        if cfg.data.augment:
            streams[0].transform = TarImages(meta, k, augment=True)
        return *streams, meta
    layout = folder_layout(Path(cfg.data.root))
    meta = image_meta(spec, [], *FOLDER_STATS[spec.channels])
    loader = partial(read_image, mode=pil_mode(meta))

    def read(path: Path) -> ImageFolder:
        try:
            return ImageFolder(str(path), loader=loader)
        except FileNotFoundError as exc:  # a class folder without images
            raise UserError(f"data.root: {str(exc).splitlines()[0]}") from None

    train_root = layout["train"]
    assert train_root is not None  # folder_layout always finds a training tree
    full = read(train_root)
    fixed = {s: read(folder) for s in ("val", "test") if (folder := layout[s]) is not None}
    for split, ds in fixed.items():
        if ds.classes != full.classes:
            raise UserError(
                f"data.root: {layout[split]} has classes {ds.classes[:5]}..., "
                f"{layout['train']} has {full.classes[:5]}...; both need the same class folders"
            )
    meta["label_names"] = list(full.classes)
    val_fraction = 0.0 if "val" in fixed else cfg.data.val_fraction
    test_fraction = 0.0 if "test" in fixed else cfg.data.test_fraction
    train, val, test = split_indices(len(full), val_fraction, test_fraction, cfg.experiment.seed)
    if cfg.data.cache != "false":  # decoded once into a cache shared by the node's ranks
        full = image_cache.cached_folder(cfg, dist, full, meta)
        fixed = {s: image_cache.cached_folder(cfg, dist, ds, meta) for s, ds in fixed.items()}
    elif cfg.data.decode == "gpu":
        full, fixed = EncodedFiles(full, meta), {s: EncodedFiles(ds, meta) for s, ds in fixed.items()}
    else:
        tf = transform(meta)
        for ds in (full, *fixed.values()):
            ds.transform = tf
    return _splits(
        cfg, meta, Subset(full, train), fixed.get("val", Subset(full, val)), fixed.get("test", Subset(full, test))
    )


SOURCES = {
    "digits": digits,
    "mnist": torchvision_set,
    "fashion_mnist": torchvision_set,
    "cifar10": torchvision_set,
    "image_folder": image_folder,
}


def data(cfg: ddplab.BuildConfig) -> ddplab.Data:
    if cfg.assets is not None:  # `ddplab predict`: the transform and labels from the saved meta; no image is read
        return _data(cfg.assets.meta, train=None)
    config = cfg.config
    spec = image_spec(config, *image_needs(config.model.name), log=_say if cfg.is_main else None)
    train, val, test, meta = SOURCES[config.data.name](config, cfg.dist, spec)
    names = meta["label_names"]
    return _data(meta, train=train, val=val, test=test, task=ddplab.Classification(len(names), names))


def _data(meta: dict, **splits) -> ddplab.Data:
    """Training's Data and predict's alike: batches stacked, and a file read, as `meta` says."""
    shape = tuple(meta["input_shape"])
    return ddplab.Data(meta=meta, collate_fn=stack_images, input_shape=shape, preprocess=ImageFile(meta), **splits)


def model(cfg: ddplab.BuildConfig, data: ddplab.Data):
    """model.name=cnn, vit or any torchvision classifier, sized to the data's images and classes."""
    return models.build(cfg.config.model, *_shape(data), data.num_classes)


def _say(why: str) -> None:
    """How a folder's image size was chosen; on stderr, since `ddplab predict` prints results on stdout."""
    print(f"data.name=image_folder: {why}", file=sys.stderr, flush=True)


def _shape(data: ddplab.Data) -> tuple[int, int]:
    """(channels, side) of one image: from the Data, or at predict time from the checkpoint's meta."""
    shape = data.input_shape or data.meta.get("input_shape")
    if not shape or len(shape) != 3:
        raise ddplab.UserError(f"an image model needs Data(input_shape=(channels, side, side)), got {shape}")
    return shape[0], shape[-1]
