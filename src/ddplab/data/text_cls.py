"""Text classification data for ddplab/workloads/text_classification.py: `datasets.Dataset` splits tokenised
by `Dataset.map` into HF's own Arrow cache (items {input_ids, label}, as a user's HF data), or shards tokenised
as they are read (data.stream).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddplab.data import streamed, text_cache, text_sources, text_synthetic
from ddplab.data.checks import tokenizer_kind
from ddplab.data.text_tokenize import HashTokenizer, HFTokenizer
from ddplab.errors import UserError

# data.name -> (its splits, label names and label mapping; a cheap description for the fingerprint)
SOURCES = {
    "imdb": (text_sources.hub_source, text_sources.hub_describe),
    "amazon_polarity": (text_sources.hub_source, text_sources.hub_describe),
    "text_files": (text_sources.files_source, text_sources.files_describe),
    "synthetic_reviews": (text_synthetic.source, text_synthetic.describe),
}


def make_tokenizer(cfg):
    if tokenizer_kind(cfg) == "hf":
        return HFTokenizer(cfg.model.pretrained, cfg.data.max_len)
    return HashTokenizer(cfg.data.vocab_size, cfg.data.max_len)


def tokenizer_description(cfg) -> dict:
    """What the cache key needs, without loading a pretrained tokenizer."""
    if tokenizer_kind(cfg) == "hf":
        p = Path(cfg.model.pretrained)
        stamp = (
            [(f.name, f.stat().st_size) for f in sorted(p.glob("*token*")) + sorted(p.glob("vocab*"))]
            if p.is_dir()
            else None
        )
        return {
            "tokenizer": "hf",
            "pretrained": str(p.resolve()) if p.is_dir() else cfg.model.pretrained,
            "files": stamp,
            "max_len": cfg.data.max_len,
        }
    return HashTokenizer(cfg.data.vocab_size, cfg.data.max_len).describe()


# ---------------------------------------------------------------------------- datasets


def tokenised_splits(cfg, dist) -> tuple[dict, list[str], tuple]:
    """(meta, label names, (train, val, test) of {input_ids, label}), mapped under a fingerprint of the source
    and tokenizer that every rank and rerun finds again: one rank a node maps first while the others wait."""
    read, describe = SOURCES[cfg.data.name]
    fields = text_sources.HUB[cfg.data.name][1] if cfg.data.name in text_sources.HUB else ("text",)
    key = {"source": describe(cfg), "tokenizer": tokenizer_description(cfg)}
    key_hash = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    out = dict[str, Any]()

    def encode(batch: dict, tokenizer, mapping: dict | None) -> dict:
        ids = tokenizer.encode_batch(["\n".join(p) for p in zip(*(batch[f] for f in fields), strict=True)])
        return {"input_ids": ids} | ({"label": [mapping[y] for y in batch["label"]]} if mapping else {})

    def tokenise() -> None:
        raw, out["names"], mapping = read(cfg)
        tokenizer = make_tokenizer(cfg)
        out["meta"] = {"input": "text", **tokenizer.describe()}
        encoder = partial(encode, tokenizer=tokenizer, mapping=mapping)
        for split, ds in raw.items():
            drop = [c for c in ds.column_names if c != "label"]
            fingerprint = f"ddplab-{key_hash}-{split}"
            out[split] = ds.map(encoder, batched=True, remove_columns=drop, new_fingerprint=fingerprint)
            out[split].set_format("torch")

    text_cache.ensure(dist, None, tokenise, f"tokenised {cfg.data.name}")
    sizes = {s: len(out[s]) for s in ("train", "val", "test") if s in out}
    return out["meta"], out["names"], splits(cfg, sizes, lambda s, rows: out[s].select(rows))


def pad_collate(items, pad_id: int):
    """Pads a batch to its longest text (not max_len): short reviews cost short sequences. Dict items give one
    dict with `labels` (none where they hold none: predict's); pairs (streamed rows) give (inputs, labels)."""
    pairs = [(it, it.get("labels", it.get("label"))) if isinstance(it, Mapping) else it for it in items]
    seqs = [inputs["input_ids"] for inputs, _ in pairs]
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id)
    lengths = torch.tensor([len(s) for s in seqs])
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    if pairs[0][1] is None:  # dicts without a target
        return {"input_ids": ids, "attention_mask": mask}
    labels = torch.tensor([int(t) for _, t in pairs], dtype=torch.long)
    if isinstance(items[0], Mapping):
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {"input_ids": ids, "attention_mask": mask}, labels


def splits(cfg, sizes: dict, pick: Callable[[str, np.ndarray], Any]):
    """(train, val, test): train rows shuffled with the seed (data.limit then takes a random subset of
    label-sorted data such as IMDB's), validation given or carved from train, val and test capped by data.limit."""
    d = cfg.data
    rows = np.random.default_rng(cfg.experiment.seed).permutation(sizes["train"])
    val = test = None
    if sizes.get("val"):
        val = pick("val", np.arange(sizes["val"])[: d.limit])
    elif d.val_fraction > 0:
        n_val = max(int(len(rows) * d.val_fraction), 1)
        val, rows = pick("train", np.sort(rows[:n_val])[: d.limit]), rows[n_val:]
    if sizes.get("test"):
        test = pick("test", np.arange(sizes["test"])[: d.limit])
    if len(rows) == 0:
        raise UserError(
            f"data.name={d.name}: no training samples left after carving data.val_fraction={d.val_fraction}"
        )
    return pick("train", rows), val, test


# ---------------------------------------------------------------------------- tokenised as read


class Encoder:
    """A raw text -> the token ids the model reads (`ddplab predict`, and streamed rows)."""

    def __init__(self, meta: dict) -> None:
        self.meta = meta
        self.tokenizer: Any = None  # loaded at the first call (a pretrained one takes seconds), in the process calling

    def __call__(self, text: str) -> dict:
        if self.tokenizer is None:  # the tokenizer that `describe()` gave this meta
            m = self.meta
            hashed = m["tokenizer"] == "hash"
            self.tokenizer = (
                HashTokenizer(m["vocab_size"], m["max_len"]) if hashed else HFTokenizer(m["pretrained"], m["max_len"])
            )
        return {"input_ids": torch.tensor(self.tokenizer.encode_batch([text])[0], dtype=torch.long)}


class TextRows:
    """data.stream: a shard row -> ({input_ids}, label id), tokenised where it is read."""

    def __init__(self, meta: dict, text: str, label: str, mapping: dict | None, classes: int, read: int) -> None:
        self.encode, self.text, self.label = Encoder(meta), text, label
        self.mapping, self.classes, self.read = mapping, classes, read  # read: the rows the labels came from

    def __call__(self, row: dict):
        value = row[self.label]
        label = self.mapping.get(str(value)) if self.mapping is not None else value
        if not isinstance(label, int) or not 0 <= label < self.classes:
            known = f"{len(self.mapping)} labels" if self.mapping is not None else f"class ids 0..{self.classes - 1}"
            raise ValueError(
                f"data.label_column '{self.label}': label {value!r} is not one of the {known} learned from the "
                f"first {self.read} rows of data.train (set data.num_classes for integer labels)"
            )
        text = row[self.text]
        return self.encode("" if text is None else str(text)), label


def stream_splits(cfg, meta: dict) -> tuple[list[str], Any, Any, Any]:
    """data.stream: (label names, train, val, test) of Shards tokenised as read."""
    import pandas as pd  # the text extra

    d = cfg.data
    train, val, test = streamed.split_shards(cfg)
    for split, path in ((train, d.train), (val, d.val), (test, d.test)):  # each split is read with the same columns
        if split is not None:
            streamed.check_columns(split, path, {"text_column": d.text_column, "label_column": d.label_column})
    rows = streamed.first_items(train, streamed.PREFIX, columns=[d.label_column])
    labels = pd.Series([row[d.label_column] for row in rows])
    try:
        names, mapping = text_sources.label_mapping([labels], d.num_classes, d.label_column)
    except UserError as err:
        raise UserError(
            f"{err} (in the first {len(rows)} rows of data.train, where data.stream learns the labels)"
        ) from None
    rows_to_items = TextRows(meta, d.text_column, d.label_column, mapping, d.num_classes or len(names), len(rows))
    for split in (train, val, test):
        if split is not None:
            split.transform = rows_to_items
    return names, train, val, test
