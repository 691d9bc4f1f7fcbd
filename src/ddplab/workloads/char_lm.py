"""A character (or byte) GPT on any text file or folder of text files; the default workload.

ddplab train data.name=text data.path=corpus.txt model.name=gpt
ddplab train data.name=text data.stream=true data.train='shards/*.txt' model.name=gpt   # bytes, one line a sample
"""

from __future__ import annotations

from functools import partial

import ddplab
from ddplab.data import streamed
from ddplab.data.text_lm import CharTokenizer, TokenChunks, byte_lines, read_corpus
from ddplab.errors import UserError
from ddplab.models.gpt import GPT, GPTConfig
from ddplab.workloads import sized_by_config


def data(cfg) -> ddplab.Data:
    d, context = cfg.config.data, cfg.config.model.context
    if d.stream:
        return _streamed(cfg.config)
    kind = d.tokenizer or "char"
    if kind not in ("char", "byte"):
        raise UserError(f"data.tokenizer={kind} does not fit data.name=text; use char or byte")
    text = read_corpus(d.path)
    tokenizer = CharTokenizer.fit(kind, text)
    tokens = tokenizer.encode(text)
    n_val = int(len(tokens) * d.val_fraction)
    train = TokenChunks(tokens[: len(tokens) - n_val], context)
    val = TokenChunks(tokens[len(tokens) - n_val :], context) if n_val > context else None
    if len(train) == 0:
        raise UserError(f"data.path: the corpus ({len(tokens)} tokens) is shorter than model.context={context}")
    return ddplab.Data(train=train, val=val, task=ddplab.LanguageModeling(tokenizer.vocab_size), meta=tokenizer.meta())


def _streamed(c) -> ddplab.Data:
    """data.stream: each line of the shards (or a row's data.text_column) one sample of bytes, read as streamed."""
    train, val, test = streamed.split_shards(c, partial(byte_lines, c.model.context, c.data.text_column))
    streamed.check_columns(train, c.data.train, {"text_column": c.data.text_column})
    tokenizer = CharTokenizer("byte")
    return ddplab.Data(
        train=train, val=val, test=test, task=ddplab.LanguageModeling(tokenizer.vocab_size), meta=tokenizer.meta()
    )


def gpt(cfg, data: ddplab.Data) -> GPT:
    return GPT(sized_by_config(GPTConfig, cfg.config.model, vocab_size=data.vocab_size))
