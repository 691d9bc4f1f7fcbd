"""Image classification, a workload file like any user's. The images keep their own channels and size unless the
model needs others: torchvision classifiers get RGB at data.image_size, else 224.
"""

from __future__ import annotations

import sys

import ddplab
from ddplab.data import vision as images
from ddplab.data.checks import image_spec
from ddplab.models import vision as models
from ddplab.registry import image_needs

SOURCES = {
    "digits": images.digits,
    "mnist": images.torchvision_set,
    "fashion_mnist": images.torchvision_set,
    "cifar10": images.torchvision_set,
    "image_folder": images.image_folder,
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
    return ddplab.Data(
        meta=meta, collate_fn=images.stack_images, input_shape=shape, preprocess=images.ImageFile(meta), **splits
    )


def cnn(cfg: ddplab.BuildConfig, data: ddplab.Data):
    return models.build_cnn(cfg.config.model, *_shape(data), data.num_classes)


def vit(cfg: ddplab.BuildConfig, data: ddplab.Data):
    return models.build_vit(cfg.config.model, *_shape(data), data.num_classes)


def torchvision_model(cfg: ddplab.BuildConfig, data: ddplab.Data):
    return models.build_torchvision(cfg.config.model, _shape(data)[1], data.num_classes)


def _say(why: str) -> None:
    """How a folder's image size was chosen; on stderr, since `ddplab predict` prints results on stdout."""
    print(f"data.name=image_folder: {why}", file=sys.stderr, flush=True)


def _shape(data: ddplab.Data) -> tuple[int, int]:
    """(channels, side) of one image: from the Data, or at predict time from the checkpoint's meta."""
    shape = data.input_shape or data.meta.get("input_shape")
    if not shape or len(shape) != 3:
        raise ddplab.UserError(f"an image model needs Data(input_shape=(channels, side, side)), got {shape}")
    return shape[0], shape[-1]
