"""Generated, learnable tensors shaped for the configured model, for smoke tests and benchmarks.

ddplab train data.name=synthetic model.name=gpt      # token sequences
ddplab train data.name=synthetic model.name=cnn      # images, one mean pattern per class
"""

from __future__ import annotations

import torch
from torch.utils.data import Subset, TensorDataset

import ddplab


def data(cfg) -> ddplab.Data:
    c = cfg.config
    g = torch.Generator().manual_seed(c.experiment.seed)
    n_val = max(int(c.data.num_samples * c.data.val_fraction), 1)
    n_train = c.data.num_samples - n_val
    n = n_train + n_val
    if c.model.name == "gpt":
        # Arithmetic sequences modulo the vocabulary: the next token is predictable.
        vocab, context = 64, c.model.context
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        seq = (start + stride * torch.arange(context + 1)) % vocab
        tokens = TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
        return ddplab.Data(
            train=Subset(tokens, range(n_train)),
            val=Subset(tokens, range(n_train, n)),
            task=ddplab.LanguageModeling(vocab),
            meta={"tokenizer": "synthetic", "vocab_size": vocab},
        )
    classes = c.data.num_classes or 10
    # The small CNN is grey-scale's model; every other image model gets RGB.
    channels, side = (1 if c.model.name == "cnn" else 3), c.data.image_size or 28
    patterns = torch.randn(classes, channels, side, side, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    images = TensorDataset(patterns[labels] + 1.5 * torch.randn(n, channels, side, side, generator=g), labels)
    return ddplab.Data(
        train=Subset(images, range(n_train)),
        val=Subset(images, range(n_train, n)),
        task=ddplab.Classification(classes, [str(i) for i in range(classes)]),
        input_shape=(channels, side, side),
        meta={"input_shape": [channels, side, side]},
    )
