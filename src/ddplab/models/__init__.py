"""Model registry: `model.name` -> builder(cfg, bundle) -> nn.Module.

Models are plain modules: they take a small config and know nothing of torch.distributed,
YAML or files.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from ddplab.errors import UserError
from ddplab.models import gpt, hf, transformer, vision

MODELS: dict[str, Callable] = {
    "gpt": gpt.build,
    "transformer": transformer.build,
    "hf": hf.build,
    "cnn": vision.build_cnn,
    "vit": vision.build_vit,
}
# Every torchvision classifier name (torchvision.models.list_models) is accepted too (see build_model).

# Which task each model serves, so a model/data mismatch is caught before training.
TASKS: dict[str, str] = {
    "gpt": "lm",
    "cnn": "classification",
    "vit": "classification",
    "transformer": "classification",
    "hf": "classification",
}


def check_model_config(cfg) -> None:
    if cfg.model.name not in MODELS and not vision.is_torchvision(cfg.model.name):
        raise UserError(vision.unknown_model(cfg.model.name, list(MODELS)))
    if cfg.model.name in ("transformer", "hf"):
        from ddplab.data.text_cls import SOURCES

        if cfg.data.name not in SOURCES:
            raise UserError(f"model.name={cfg.model.name} classifies text: set data.name to one of "
                            f"{', '.join(sorted(SOURCES))} (got data.name={cfg.data.name})")
    if cfg.model.name == "hf":
        hf.check_pretrained(cfg.model.pretrained)


def check_model_files(cfg) -> None:
    """Files the model section names (model.weights) exist and fit; run before launch."""
    vision.check_files(cfg)


def build_model(cfg, bundle) -> nn.Module:
    torchvision_model = cfg.model.name not in MODELS and vision.is_torchvision(cfg.model.name)
    task = "classification" if torchvision_model else TASKS.get(cfg.model.name)
    if task is not None and task != bundle.task:
        raise UserError(f"model.name={cfg.model.name} does a {task} task but data.name={cfg.data.name} is {bundle.task} data")
    return (vision.build_torchvision if torchvision_model else MODELS[cfg.model.name])(cfg, bundle)
