"""A model that computes its own loss, as nanoGPT's does: forward(idx, targets=None) returns
(logits, loss). The dataset's inputs are a dict {"idx": x, "targets": y}, passed to forward as
keywords, and a Task whose loss is the one the model returned.

    ddplab train model.name=examples/own_loss.py:model data.name=examples/own_loss.py:data \
        data.options.path=input.txt training.epochs=2 --nproc-per-node 2

data.options.path defaults to the Shakespeare excerpt that ships with ddplab.
"""

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import ddplab


class ModelsOwnLoss(ddplab.Task):
    """The loss is the model's; validation reports its mean (val_loss)."""

    def loss(self, output, target):
        logits, loss = output  # the model's forward(idx, targets) return value, as it returned it
        return loss

    def tokens(self, inputs, target):
        return target.numel()


class CharWindows(torch.utils.data.Dataset):
    """Consecutive windows of `block` characters: the model reads x and is scored on y, x shifted by one."""

    def __init__(self, ids: torch.Tensor, block: int) -> None:
        self.ids, self.block = ids, block

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i):
        chunk = self.ids[i * self.block: (i + 1) * self.block + 1]
        x, y = chunk[:-1], chunk[1:]
        return {"idx": x, "targets": y}, y


def data(cfg):
    default = Path(ddplab.__file__).parent / "resources" / "shakespeare.txt"
    text = Path(cfg.options.get("path", default)).read_text(encoding="utf-8")[: cfg.options.get("chars", 200_000)]
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    split, block = int(0.9 * len(ids)), cfg.options.get("block", 32)
    return ddplab.Data(train=CharWindows(ids[:split], block), val=CharWindows(ids[split:], block),
                       task=ModelsOwnLoss(), meta={"chars": "".join(chars)})


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, block: int, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        logits = self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))  # (B, T, vocab)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def model(cfg, data):
    o = cfg.options
    return CharGPT(len(data.meta["chars"]), data.train.block, o.get("dim", 64), o.get("heads", 4), o.get("layers", 2))
