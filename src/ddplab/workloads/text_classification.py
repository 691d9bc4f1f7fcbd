"""Text classification: a Transformer encoder from scratch on hash tokens, or any Hugging Face
sequence classifier fine-tuned with its own tokenizer. The data: `datasets.Dataset` splits tokenised by
`Dataset.map` into HF's own Arrow cache (items {input_ids, label}, as a user's HF data), or shards tokenised as
they are read (data.stream).

    ddplab train data.name=imdb model.name=transformer
    ddplab train data.name=text_files data.train=train.csv model.name=hf model.pretrained=<hub name or folder>
    ddplab train data.name=text_files data.stream=true data.train='shards/*.parquet' model.name=transformer
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import ddplab
from ddplab.data import shards, text_cache, text_sources
from ddplab.data.checks import tokenizer_kind
from ddplab.errors import UserError
from ddplab.models.checks import cannot_load, check_hf, looks_like_path
from ddplab.models.transformer import TransformerClassifier, TransformerConfig
from ddplab.workloads import sized_by_config

# Words (letters, digits, underscore; any script) and single punctuation marks.
_TOKEN = re.compile(r"\w+|[^\w\s]")


class HashTokenizer:
    """Lower-case words hashed by CRC-32 (unlike Python's `hash`, the same in every process) into
    2 .. vocab_size-1; 0 pads, 1 is the leading [CLS] position."""

    PAD, CLS, RESERVED = 0, 1, 2
    # Bound on the word -> id memo; real corpora are Zipfian, so a modest memo hits almost always.
    MEMO = 1_000_000

    def __init__(self, vocab_size: int, max_len: int) -> None:
        if vocab_size <= self.RESERVED:
            raise UserError(f"data.vocab_size must be > {self.RESERVED} for the hash tokenizer, got {vocab_size}")
        if max_len < 2:
            raise UserError(f"data.max_len must be >= 2 (one [CLS] position plus words), got {max_len}")
        self.vocab_size, self.max_len = vocab_size, max_len
        self._memo: dict[str, int] = {}

    def describe(self) -> dict:
        return {
            "tokenizer": "hash",
            "vocab_size": self.vocab_size,
            "max_len": self.max_len,
            "lowercase": True,
            "split": _TOKEN.pattern,
            "hash": "crc32",
            "pad_id": self.PAD,
            "cls_id": self.CLS,
        }

    def words(self, text: str) -> list[str]:
        keep = self.max_len - 1
        # Scan only a prefix long enough for `keep` words; fall back to the whole text if it was not.
        prefix = text[: keep * 24].lower()
        words = _TOKEN.findall(prefix)
        if len(words) < keep and len(prefix) < len(text):
            words = _TOKEN.findall(text.lower())
        return words[:keep]

    def _bucket(self, word: str) -> int:
        i = zlib.crc32(word.encode("utf-8")) % (self.vocab_size - self.RESERVED) + self.RESERVED
        if len(self._memo) >= self.MEMO:
            self._memo.clear()
        self._memo[word] = i
        return i

    def encode(self, text: str) -> list[int]:
        memo, bucket = self._memo, self._bucket
        return [self.CLS] + [memo[w] if w in memo else bucket(w) for w in self.words(text)]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]


class HFTokenizer:
    """A pretrained model's own tokenizer (AutoTokenizer), truncating to `max_len`."""

    def __init__(self, pretrained: str, max_len: int) -> None:
        from transformers import AutoTokenizer  # the text extra; seconds to import

        try:
            self.tok = AutoTokenizer.from_pretrained(pretrained)
        except (OSError, ValueError) as exc:
            raise cannot_load(f"a tokenizer from '{pretrained}'", exc) from None
        self.pretrained = pretrained
        longest = self.tok.model_max_length  # a huge sentinel where the tokenizer names no limit
        self.max_len = min(max_len, longest) if longest and longest < 10**6 else max_len
        self.vocab_size = len(self.tok)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0

    def describe(self) -> dict:
        return {
            "tokenizer": "hf",
            "pretrained": self.pretrained,
            "max_len": self.max_len,
            "vocab_size": self.vocab_size,
            "pad_id": self.pad_id,
            "class": type(self.tok).__name__,
        }

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tok(list(texts), truncation=True, max_length=self.max_len)["input_ids"]


PREFIX = 10_000  # rows of the training shards a streamed text classifier's labels are learned from
# data.name -> (its splits, label names and label mapping; a cheap description for the fingerprint)
SOURCES = {
    "imdb": (text_sources.hub_source, text_sources.hub_describe),
    "amazon_polarity": (text_sources.hub_source, text_sources.hub_describe),
    "text_files": (text_sources.files_source, text_sources.files_describe),
    "synthetic_reviews": (text_sources.synthetic_source, text_sources.synthetic_describe),
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
    tokenised = {s: out[s] for s in ("train", "val", "test") if s in out}
    return out["meta"], out["names"], splits(cfg, tokenised)


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


def splits(cfg, tokenised: dict):
    """(train, val, test): train rows shuffled with the seed (data.limit then takes a random subset of
    label-sorted data such as IMDB's), validation given or carved from train, val and test capped by data.limit."""
    d, train = cfg.data, tokenised["train"]
    given = {s: ds.select(range(len(ds))[: d.limit]) for s, ds in tokenised.items() if s != "train" and len(ds)}
    rows = np.random.default_rng(cfg.experiment.seed).permutation(len(train))
    val = given.get("val")
    if val is None and d.val_fraction > 0:
        n_val = max(int(len(rows) * d.val_fraction), 1)
        val, rows = train.select(np.sort(rows[:n_val])[: d.limit]), rows[n_val:]
    if len(rows) == 0:
        raise UserError(
            f"data.name={d.name}: no training samples left after carving data.val_fraction={d.val_fraction}"
        )
    return train.select(rows), val, given.get("test")


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


def data(cfg) -> ddplab.Data:
    if cfg.assets is not None:  # `ddplab predict`: the tokenizer the run saved in meta; no text is read
        return _data(cfg.assets.meta, train=None)
    c, d = cfg.config, cfg.config.data
    if d.stream:  # shards tokenised as they are read; the labels learned from the first PREFIX rows
        import pandas as pd  # the text extra

        meta = {"input": "text", **make_tokenizer(c).describe()}
        train, val, test = shards.split_shards(c)
        for split, path in ((train, d.train), (val, d.val), (test, d.test)):  # each split is read with the same columns
            if split is not None:
                shards.check_columns(split, path, {"text_column": d.text_column, "label_column": d.label_column})
        rows = shards.first_items(train, PREFIX, columns=[d.label_column])
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
    else:  # datasets.Dataset splits, as a user's HF data
        meta, names, (train, val, test) = tokenised_splits(c, cfg.dist)
    k = d.num_classes or len(names)
    if k < len(names):
        raise UserError(f"data.num_classes={k} but data.name={d.name} has {len(names)} labels ({', '.join(names)})")
    meta["label_names"] = names = names + [str(i) for i in range(len(names), k)]
    return _data(meta, train=train, val=val, test=test, task=ddplab.Classification(k, names))


def _data(meta: dict, **splits) -> ddplab.Data:
    """Training's Data and predict's alike: texts encoded, and batches padded, as `meta` says."""
    collate = partial(pad_collate, pad_id=meta.get("pad_id", 0))
    return ddplab.Data(meta=meta, collate_fn=collate, preprocess=Encoder(meta), **splits)


def transformer(cfg, data: ddplab.Data) -> TransformerClassifier:
    meta = data.meta
    return TransformerClassifier(
        sized_by_config(
            TransformerConfig,
            cfg.config.model,
            vocab_size=data.vocab_size,
            num_classes=data.num_classes,
            max_len=meta.get("max_len", cfg.config.data.max_len),
            pad_id=meta.get("pad_id", 0),
        )
    )


def hf(cfg, data: ddplab.Data) -> nn.Module:
    """A pretrained encoder with a fresh head sized to this data's labels."""
    from transformers import AutoModelForSequenceClassification  # seconds to import: only for model.name=hf

    m = cfg.config.model
    check_hf(cfg.config)
    names = data.meta.get("label_names") or [str(i) for i in range(data.num_classes)]
    source = str(Path(m.pretrained).expanduser()) if looks_like_path(m.pretrained) else m.pretrained
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            source,
            num_labels=data.num_classes,
            id2label=dict(enumerate(names)),
            label2id={n: i for i, n in enumerate(names)},
            ignore_mismatched_sizes=True,
        )
    except (OSError, ValueError) as exc:
        raise cannot_load(f"'{m.pretrained}' as a sequence classifier", exc) from None
    if m.freeze:
        model.base_model.requires_grad_(False)
    return model
