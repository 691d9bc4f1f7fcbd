"""Transformer encoder classifier, trained from scratch on hash-tokenizer ids. A plain nn.Module."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class TransformerConfig:
    vocab_size: int
    num_classes: int
    max_len: int = 256
    layers: int = 2
    heads: int = 4
    dim: int = 128
    ff_dim: int | None = None
    dropout: float = 0.1
    pooling: str = "cls"  # "cls": the first position; "mean": the average over real tokens
    pad_id: int = 0


def sinusoidal(max_len: int, dim: int) -> torch.Tensor:
    """The fixed positional encoding of "Attention is all you need": (max_len, dim)."""
    pos = torch.arange(max_len, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    pe = torch.zeros(max_len, dim)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq[: dim // 2])
    return pe


class TransformerClassifier(nn.Module):
    positions: torch.Tensor  # a buffer

    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.dim, padding_idx=c.pad_id)
        self.register_buffer("positions", sinusoidal(c.max_len, c.dim), persistent=False)
        self.drop = nn.Dropout(c.dropout)
        layer = nn.TransformerEncoderLayer(
            c.dim, c.heads, c.ff_dim or 4 * c.dim, c.dropout, activation="gelu", batch_first=True, norm_first=True
        )
        # Nested tensors would skip padded positions faster in eval, but only for post-norm layers.
        self.encoder = nn.TransformerEncoder(layer, c.layers, norm=nn.LayerNorm(c.dim), enable_nested_tensor=False)
        self.head = nn.Linear(c.dim, c.num_classes)
        self.scale = math.sqrt(c.dim)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids (B, T), attention_mask (B, T) 1 on real tokens -> logits (B, num_classes); `labels` ignored."""
        if attention_mask is None:
            attention_mask = (input_ids != self.config.pad_id).long()
        T = input_ids.shape[1]
        x = self.drop(self.embed(input_ids) * self.scale + self.positions[:T])  # (B, T, C)
        x = self.encoder(x, src_key_padding_mask=attention_mask == 0)  # (B, T, C)
        if self.config.pooling == "mean":
            m = attention_mask.unsqueeze(-1).to(x.dtype)
            pooled = (x * m).sum(1) / m.sum(1).clamp(min=1)
        else:
            pooled = x[:, 0]
        return self.head(pooled)  # (B, num_classes)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x the encoder's weights (embeddings are no matmuls, the head runs once per
        text) plus attention over max_len positions (an upper bound: batches are padded to their longest text)."""
        c = self.config
        return 6 * sum(p.numel() for p in self.encoder.parameters()) + 12 * c.layers * c.dim * c.max_len
