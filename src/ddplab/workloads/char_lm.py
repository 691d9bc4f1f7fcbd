"""A character (or byte) GPT on any text file or folder of text files; the default workload.

ddplab train data.name=text data.path=corpus.txt model.name=gpt
ddplab train data.name=text data.stream=true data.train='shards/*.txt' model.name=gpt   # bytes, one line a sample
"""

from __future__ import annotations

from functools import partial
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

import ddplab
from ddplab.data import shards
from ddplab.errors import UserError
from ddplab.models.gpt import GPT, GPTConfig
from ddplab.workloads import sized_by_config


def embedded_corpus() -> str:
    return resources.files("ddplab.resources").joinpath("shakespeare.txt").read_text(encoding="utf-8")


def read_corpus(path: str | None) -> str:
    if path is None:
        return embedded_corpus()
    p = Path(path)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".txt", ".md", ".text", ""))
        if not files:
            raise UserError(f"data.path: folder {path} holds no .txt files")
    else:
        raise UserError(f"data.path: no such file or folder: {path}")
    texts = []
    for f in files:  # a binary file would silently train on a vocabulary of junk (hundreds of symbols): refused
        raw = f.read_bytes()
        try:
            texts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise UserError(
                f"data.path: {f} is not UTF-8 text (byte {err.start}: {raw[err.start]:#04x}); "
                "give a text file, or convert it to UTF-8"
            ) from None
        if "\x00" in texts[-1]:
            raise UserError(f"data.path: {f} holds NUL bytes: a binary file, not text")
    text = "\n".join(texts)
    if len(text) < 16:
        raise UserError(f"data.path: {path} holds too little text ({len(text)} characters)")
    return text


class CharTokenizer:
    """Characters of the corpus (sorted), or all 256 bytes. Its state lives in checkpoints."""

    def __init__(self, kind: str, chars: str = "") -> None:
        self.kind, self.chars = kind, chars
        self.index = {c: i for i, c in enumerate(chars)}

    @classmethod
    def fit(cls, kind: str, text: str) -> CharTokenizer:
        return cls(kind, "".join(sorted(set(text))) if kind == "char" else "")

    @classmethod
    def from_meta(cls, meta: dict) -> CharTokenizer:
        return cls(meta["tokenizer"], meta.get("chars", ""))

    def meta(self) -> dict:
        return {"tokenizer": self.kind, "chars": self.chars, "vocab_size": self.vocab_size}

    @property
    def vocab_size(self) -> int:
        return 256 if self.kind == "byte" else len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        if self.kind == "byte":
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        unknown = set(text) - self.index.keys()
        if unknown:
            raise UserError(f"characters not in the model's vocabulary: {''.join(sorted(unknown))[:20]!r}")
        return np.fromiter((self.index[c] for c in text), dtype=np.int64, count=len(text))

    def decode(self, ids) -> str:
        if self.kind == "byte":
            return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
        return "".join(self.chars[int(i)] for i in ids)


class TokenChunks(Dataset):
    """Non-overlapping windows of `context + 1` tokens: input and next-token target."""

    def __init__(self, tokens: np.ndarray, context: int) -> None:
        self.tokens = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
        self.context = context

    def __len__(self) -> int:
        return max((len(self.tokens) - 1) // self.context, 0)

    def __getitem__(self, i: int):
        chunk = self.tokens[i * self.context : i * self.context + self.context + 1]
        return chunk[:-1], chunk[1:]


def byte_lines(context: int, column: str, item) -> tuple[torch.Tensor, torch.Tensor]:
    """data.stream: a line (or a row's `column`) with its newline -> its first `context + 1` UTF-8 bytes as
    (input, next-byte target), a shorter one padded and the padding not scored (target -100)."""
    text = item if isinstance(item, str) else str(item[column])
    ids = torch.tensor(list((text + "\n").encode("utf-8")[: context + 1]), dtype=torch.long)
    n = len(ids) - 1
    x = torch.zeros(context, dtype=torch.long)
    y = torch.full((context,), -100, dtype=torch.long)
    x[:n], y[:n] = ids[:-1], ids[1:]
    return x, y


def data(cfg) -> ddplab.Data:
    d, context = cfg.config.data, cfg.config.model.context
    splits: tuple[Dataset, Dataset | None, Dataset | None]
    if d.stream:  # each line of the shards (or a row's data.text_column) one sample of bytes, read as streamed
        splits = shards.split_shards(cfg.config, partial(byte_lines, context, d.text_column))
        shards.check_columns(splits[0], d.train, {"text_column": d.text_column})
        tokenizer = CharTokenizer("byte")
    else:
        kind = d.tokenizer or "char"
        if kind not in ("char", "byte"):
            raise UserError(f"data.tokenizer={kind} does not fit data.name=text; use char or byte")
        text = read_corpus(d.path)
        tokenizer = CharTokenizer.fit(kind, text)
        tokens = tokenizer.encode(text)
        n_val = int(len(tokens) * d.val_fraction)
        chunks = TokenChunks(tokens[: len(tokens) - n_val], context)
        if len(chunks) == 0:
            raise UserError(f"data.path: the corpus ({len(tokens)} tokens) is shorter than model.context={context}")
        splits = chunks, TokenChunks(tokens[len(tokens) - n_val :], context) if n_val > context else None, None
    train, val, test = splits
    return ddplab.Data(
        train=train, val=val, test=test, task=ddplab.LanguageModeling(tokenizer.vocab_size), meta=tokenizer.meta()
    )


def gpt(cfg, data: ddplab.Data) -> GPT:
    return GPT(sized_by_config(GPTConfig, cfg.config.model, vocab_size=data.vocab_size))
