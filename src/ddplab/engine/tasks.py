"""How a batch becomes a loss, and which evaluator scores a split, per kind of task."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ddplab.metrics.evaluation import ClassificationEvaluator, LMEvaluator


def call_model(model: torch.nn.Module, inputs) -> torch.Tensor:
    """Tensor inputs go positionally, dict inputs as keywords; HF outputs give their logits."""
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out.logits if hasattr(out, "logits") else out


def to_device(obj, device: torch.device):
    non_blocking = device.type == "cuda"
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


class LanguageModeling:
    kind = "lm"

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())

    def tokens(self, inputs, target: torch.Tensor) -> int:
        return target.numel()

    def evaluator(self, device: torch.device) -> LMEvaluator:
        return LMEvaluator(device)


class Classification:
    kind = "classification"

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), target)

    def tokens(self, inputs, target: torch.Tensor):
        if isinstance(inputs, dict) and "attention_mask" in inputs:
            return inputs["attention_mask"].sum()
        if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point():
            return inputs.numel()
        return 0

    def evaluator(self, device: torch.device) -> ClassificationEvaluator:
        return ClassificationEvaluator(self.num_classes, device)


def make_task(bundle):
    if bundle.task == "lm":
        return LanguageModeling()
    return Classification(bundle.num_classes)
