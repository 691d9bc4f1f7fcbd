"""Text classification: a Transformer encoder from scratch on hash tokens, or any Hugging Face
sequence classifier fine-tuned with its own tokenizer.

    ddplab train data.name=imdb model.name=transformer
    ddplab train data.name=text_files data.train=train.csv model.name=hf model.pretrained=<hub name or folder>
    ddplab train data.name=text_files data.stream=true data.train='shards/*.parquet' model.name=transformer
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from torch import nn

import ddplab
from ddplab.data.text_cls import Encoder, make_tokenizer, pad_collate, stream_splits, tokenised_splits
from ddplab.errors import UserError
from ddplab.models.checks import cannot_load, check_hf, looks_like_path
from ddplab.models.transformer import TransformerClassifier, TransformerConfig
from ddplab.workloads import sized_by_config


def data(cfg) -> ddplab.Data:
    if cfg.assets is not None:  # `ddplab predict`: the tokenizer the run saved in meta; no text is read
        return _data(cfg.assets.meta, train=None)
    c = cfg.config
    if c.data.stream:  # shards tokenised as they are read
        meta = {"input": "text", **make_tokenizer(c).describe()}
        names, train, val, test = stream_splits(c, meta)
    else:  # datasets.Dataset splits, as a user's HF data
        meta, names, (train, val, test) = tokenised_splits(c, cfg.dist)
    k = c.data.num_classes or len(names)
    if k < len(names):
        raise UserError(
            f"data.num_classes={k} but data.name={c.data.name} has {len(names)} labels ({', '.join(names)})"
        )
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
