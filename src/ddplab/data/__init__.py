"""Dataset registry: `data.name` -> builder(cfg, ctx) -> DataBundle."""

from __future__ import annotations

from typing import Callable

from torch.utils.data import Subset

from ddplab.data import synthetic, text_cls, text_lm, vision
from ddplab.data.bundle import DataBundle
from ddplab.errors import UserError

DATASETS: dict[str, Callable] = {
    "text": text_lm.build,
    "synthetic": synthetic.build,
    "digits": vision.build_digits,
    "mnist": vision.build_torchvision,
    "fashion_mnist": vision.build_torchvision,
    "cifar10": vision.build_torchvision,
    "image_folder": vision.build_image_folder,
    "imdb": text_cls.build,
    "amazon_polarity": text_cls.build,
    "text_files": text_cls.build,
    "synthetic_reviews": text_cls.build,
}


def check_data_config(cfg) -> None:
    """Cheap checks before any process starts."""
    if cfg.data.name not in DATASETS:
        raise UserError(f"data.name: unknown dataset '{cfg.data.name}'; choose one of {', '.join(sorted(DATASETS))}")
    if cfg.data.name == "text" and cfg.data.path is not None:
        from pathlib import Path

        if not Path(cfg.data.path).exists():
            raise UserError(f"data.path: no such file or folder: {cfg.data.path}")
    if cfg.data.name in vision.NATIVE:
        vision.check_config(cfg)
    if cfg.data.name in text_cls.SOURCES:
        text_cls.check_config(cfg)


def check_data_files(cfg) -> None:
    """Dataset folders the config names exist and hold what the loader reads; run before launch."""
    if cfg.data.name in vision.NATIVE:
        vision.check_files(cfg)


def build_data(cfg, ctx) -> DataBundle:
    bundle = DATASETS[cfg.data.name](cfg, ctx)
    if cfg.data.limit is not None and cfg.data.limit < len(bundle.train):
        bundle.train = Subset(bundle.train, range(cfg.data.limit))
    return bundle
