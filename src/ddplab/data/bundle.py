"""What a dataset builder hands the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch.utils.data import Dataset


@dataclass
class DataBundle:
    """Splits plus what the model and inference need to know about the data.

    Every item of every split is `(inputs, target)`; `inputs` is a tensor, or a dict of
    tensors passed to the model as keyword arguments.
    """

    task: str  # "lm" | "classification"
    train: Dataset
    val: Dataset | None
    test: Dataset | None = None
    num_classes: int | None = None
    vocab_size: int | None = None
    # Stored with checkpoints so that inference rebuilds the same tokenizer / labels.
    meta: dict[str, Any] = field(default_factory=dict)
    collate_fn: Callable | None = None
    # Input shape of one sample (images), for models that need it.
    input_shape: tuple[int, ...] | None = None
