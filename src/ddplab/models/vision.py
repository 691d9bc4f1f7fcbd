"""Image classifiers: the FashionMNIST-tutorial CNN, a small ViT, and torchvision's classifiers by name with the
head replaced for the data's classes. Weights come from a local file (`model.weights`); nothing here downloads.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision import models
from torchvision.models import VisionTransformer

from ddplab.errors import UserError, first_line
from ddplab.models.checks import CNN_MIN_SIDE

IMAGENET_CLASSES = 1000  # torchvision builds every classifier with this head first
IMAGENET_SIDE = 224  # the side torchvision's weights were made for: the default where data.image_size is unset


class CNN(nn.Module):
    """Two 3x3 convolutions, max-pool, dropout, two linear layers (the FashionMNIST tutorial net)."""

    def __init__(
        self, in_channels: int, num_classes: int, image_size: int, dropout: float = 0.25, hidden: int = 128
    ) -> None:
        super().__init__()
        if image_size < CNN_MIN_SIDE:
            raise ValueError(f"CNN needs images of at least {CNN_MIN_SIDE}x{CNN_MIN_SIDE}, got {image_size}")
        self.conv1 = nn.Conv2d(in_channels, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        side = (image_size - 4) // 2
        self.dropout1 = nn.Dropout(dropout)
        self.fc1 = nn.Linear(64 * side * side, hidden)
        self.dropout2 = nn.Dropout(min(2 * dropout, 0.9))  # the tutorial's 0.25 / 0.5 pair
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, S, S) -> (B, classes)
        x = F.relu(self.conv1(x))  # (B, 32, S-2, S-2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # (B, 64, (S-4)/2, (S-4)/2)
        x = self.dropout1(x).flatten(1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return self.fc2(x)


def torchvision_names() -> list[str]:
    return models.list_models(module=models)  # classifiers only: detection etc. live in sub-modules


def is_torchvision(name: str) -> bool:
    return name in torchvision_names()


def compact(names: list[str]) -> str:
    """'resnet{18,34,50}, vgg{11,11_bn}, alexnet': every name, grouped by family."""
    families: dict[str, list[str]] = defaultdict(list)
    for name in names:
        family = re.split(r"[^a-z]", name, maxsplit=1)[0]
        families[family].append(name[len(family) :])
    parts = []
    for family, rests in sorted(families.items()):
        rests = sorted(  # '101' after '50': digits compare as numbers
            rests, key=lambda r: [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", r)]
        )
        parts.append(family + rests[0] if len(rests) == 1 else f"{family}{{{','.join(rests)}}}")
    return ", ".join(parts)


def unknown_model(name: str, own: list[str]) -> str:
    tv = torchvision_names()
    close = difflib.get_close_matches(name, own + tv, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return (
        f"model.name: unknown model '{name}'{hint}; choose one of {', '.join(sorted(own))}, "
        f"or a torchvision classifier: {compact(tv)}"
    )


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """A state dict from a local file (plain, or inside a 'state_dict' / 'model' entry)."""
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # reads only what is used
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except FileNotFoundError:
        raise UserError(f"model.weights: no such file: {path}") from None
    except Exception as exc:  # noqa: BLE001 - anything unreadable is the user's file, not a bug
        raise UserError(
            f"model.weights: cannot read {path} as a state dict ({first_line(exc, 120) or type(exc).__name__})"
        ) from None
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise UserError(f"model.weights: {path} is not a state dict (a mapping of parameter names to tensors)")
    return {k.removeprefix("module."): v for k, v in obj.items()}  # saved from a DDP-wrapped model


def fitting_weights(model: nn.Module, path: str, name: str) -> dict[str, torch.Tensor]:
    """The state dict in `path`, which loads into `model` strictly, or a UserError says why in a few words."""
    weights = read_weights(path)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    shapes = [
        f"{k} {tuple(weights[k].shape)} vs {own[k]}" for k in own if k in weights and tuple(weights[k].shape) != own[k]
    ]
    kinds = {"missing": missing, "unexpected": unexpected, "of another shape": shapes}
    found = [f"{len(keys)} {kind} (e.g. {keys[0]})" for kind, keys in kinds.items() if keys]
    if found:
        raise UserError(f"model.weights: {path} does not fit {name}: {'; '.join(found)}")
    return weights


def _torchvision(name: str, side: int) -> nn.Module:
    kwargs = {}
    if name.startswith("vit_"):
        kwargs = {"image_size": side}  # position embeddings are sized for the input
    elif name in ("googlenet", "inception_v3"):
        kwargs = {"aux_logits": False, "init_weights": True}  # one output; training mode returns a tuple otherwise
    return models.get_model(name, weights=None, **kwargs)


def build(m, channels: int, side: int, num_classes: int) -> nn.Module:
    """`m.name` for images of (channels, side): the CNN, the small ViT, or a torchvision classifier (random
    init, then m.weights, then a new head for the classes); with m.freeze only the head trains."""
    if m.name == "cnn":
        model: nn.Module = CNN(channels, num_classes, side, dropout=m.dropout)
        head = model.fc2
    elif m.name == "vit":
        model, head = _vit(m, channels, side, num_classes)
    else:
        # With weights, built on the meta device and given the file's tensors: random init of 100M+ parameters (VGG)
        # costs seconds and would be overwritten anyway.
        with torch.device("meta") if m.weights else contextlib.nullcontext():
            model = _torchvision(m.name, side)
        if m.weights:
            weights = fitting_weights(model, m.weights, m.name)
            model.load_state_dict(weights, assign=True)
            if any(t.is_meta for t in (*model.parameters(), *model.buffers())):  # a buffer the file does not hold
                model = _torchvision(m.name, side)
                model.load_state_dict(weights)
        heads = [  # the layers that make ImageNet's logits (a Linear, or squeezenet's 1x1 conv); the last is the head
            (name, layer)
            for name, layer in model.named_modules()
            if (isinstance(layer, nn.Linear) and layer.out_features == IMAGENET_CLASSES)
            or (isinstance(layer, nn.Conv2d) and layer.out_channels == IMAGENET_CLASSES)
        ]
        if not heads:
            raise UserError(f"model.name: cannot find the classification head of {type(model).__name__}")
        name, old = heads[-1]
        if isinstance(old, nn.Linear):
            head = nn.Linear(old.in_features, num_classes)
        else:
            head = nn.Conv2d(old.in_channels, num_classes, kernel_size=1)
        model.set_submodule(name, head)
    if m.weights and m.name in ("cnn", "vit"):  # a torchvision classifier's were loaded before its head changed
        model.load_state_dict(fitting_weights(model, m.weights, m.name))
    if m.freeze:
        model.requires_grad_(False)
        head.requires_grad_(True)
    return model


def _vit(m, channels: int, side: int, num_classes: int) -> tuple[nn.Module, nn.Module]:
    """torchvision's VisionTransformer sized by the model section; its patch embedding, made for 3 channels,
    replaced for others."""
    if side % m.patch_size:
        raise UserError(f"model.patch_size={m.patch_size} must divide the image side {side} (data.image_size)")
    model = VisionTransformer(
        image_size=side,
        patch_size=m.patch_size,
        num_layers=m.layers,
        num_heads=m.heads,
        hidden_dim=m.dim,
        mlp_dim=m.ff_dim or 4 * m.dim,
        dropout=m.dropout,
        num_classes=num_classes,
    )
    if channels != 3:
        model.conv_proj = nn.Conv2d(channels, m.dim, kernel_size=m.patch_size, stride=m.patch_size)
        fan_in = channels * m.patch_size**2  # torchvision's own initialisation of this layer
        nn.init.trunc_normal_(model.conv_proj.weight, std=(1 / fan_in) ** 0.5)
        nn.init.zeros_(model.conv_proj.bias)
    return model, model.heads


def check_input(cfg) -> None:
    """A torchvision classifier takes RGB at data.image_size (else its default side): a forward
    pass on the meta device (no memory, no init time) finds what does not fit, before launch."""
    name, side = cfg.model.name, cfg.data.image_size or IMAGENET_SIDE
    try:
        with torch.device("meta"):
            _torchvision(name, side).eval()(torch.empty(1, 3, side, side))
    except (RuntimeError, ValueError, AssertionError) as exc:
        raise UserError(
            f"data.image_size: {side}x{side} images do not fit model.name={name} "
            f"({first_line(exc, 120) or type(exc).__name__}); set another data.image_size"
        ) from None


def check_files(cfg) -> None:
    """Before launch (registry.TORCHVISION's check): the weights file exists and fits the architecture."""
    if not cfg.model.weights:
        return
    with torch.device("meta"):  # shapes without memory or init time
        model = _torchvision(cfg.model.name, cfg.data.image_size or IMAGENET_SIDE)
    fitting_weights(model, cfg.model.weights, cfg.model.name)
