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
    n = c.data.num_samples
    n_train = n - max(int(n * c.data.val_fraction), 1)
    if c.model.name == "gpt":
        # Arithmetic sequences modulo the vocabulary: the next token is predictable.
        vocab, context = 64, c.model.context
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 8, (n, 1), generator=g)
        seq = (start + stride * torch.arange(context + 1)) % vocab
        samples = TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())
        task, meta, shape = ddplab.LanguageModeling(vocab), {"tokenizer": "synthetic", "vocab_size": vocab}, None
    else:
        classes = c.data.num_classes or 10
        # The small CNN is grey-scale's model; every other image model gets RGB.
        channels, side = (1 if c.model.name == "cnn" else 3), c.data.image_size or 28
        patterns = torch.randn(classes, channels, side, side, generator=g)
        labels = torch.randint(0, classes, (n,), generator=g)
        samples = TensorDataset(patterns[labels] + 1.5 * torch.randn(n, channels, side, side, generator=g), labels)
        task = ddplab.Classification(classes, [str(i) for i in range(classes)])
        shape, meta = (channels, side, side), {"input_shape": [channels, side, side]}
    train, val = Subset(samples, range(n_train)), Subset(samples, range(n_train, n))
    return ddplab.Data(train=train, val=val, task=task, input_shape=shape, meta=meta)
