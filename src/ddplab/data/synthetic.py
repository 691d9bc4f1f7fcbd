"""Generated, learnable tensors of the right shape, for smoke tests and benchmarks."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from ddplab.data.bundle import DataBundle


def _split(n: int, val_fraction: float) -> tuple[int, int]:
    n_val = max(int(n * val_fraction), 1)
    return n - n_val, n_val


def build(cfg, ctx) -> DataBundle:
    g = torch.Generator().manual_seed(cfg.experiment.seed)
    n_train, n_val = _split(cfg.data.num_samples, cfg.data.val_fraction)
    n = n_train + n_val
    if cfg.model.name == "gpt":
        # Arithmetic sequences modulo the vocabulary: the next token is predictable.
        vocab, context = 64, cfg.model.context
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        seq = (start + stride * torch.arange(context + 1)) % vocab
        data = TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
        train = torch.utils.data.Subset(data, range(n_train))
        val = torch.utils.data.Subset(data, range(n_train, n))
        return DataBundle(task="lm", train=train, val=val, vocab_size=vocab,
                          meta={"tokenizer": "synthetic", "vocab_size": vocab})
    # Images: each class has its own mean pattern under Gaussian noise.
    classes = cfg.data.num_classes or 10
    side = cfg.data.image_size or 28
    channels = 3 if cfg.model.name not in ("cnn",) else 1
    patterns = torch.randn(classes, channels, side, side, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    images = patterns[labels] + 1.5 * torch.randn(n, channels, side, side, generator=g)
    data = TensorDataset(images, labels)
    return DataBundle(
        task="classification",
        train=torch.utils.data.Subset(data, range(n_train)),
        val=torch.utils.data.Subset(data, range(n_train, n)),
        num_classes=classes,
        input_shape=(channels, side, side),
        meta={"label_names": [str(i) for i in range(classes)], "input_shape": [channels, side, side]},
    )
