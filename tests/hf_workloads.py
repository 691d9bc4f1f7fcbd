"""Workloads for tests/test_hf_data.py, as a user brings them: a Hugging Face Dataset with a collator
and a model that computes its own loss, and torch / Hugging Face streams (no download: everything is
built here)."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import torch

import ddplab

WORDS = ["good", "great", "fine", "nice", "bad", "awful", "poor", "sad", "the", "a", "film", "plot", "was", "very"]


def tokenizer():
    """A word-level tokenizer trained here, wrapped as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]")


def reviews(n: int, seed: int):
    """Texts of 2 to 9 words whose label is whether they hold more positive words than negative ones."""
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        label = rng.randrange(2)
        mood = WORDS[:4] if label else WORDS[4:8]
        words = [rng.choice(mood)] + [rng.choice(WORDS[8:] + mood) for _ in range(rng.randrange(1, 9))]
        texts.append(" ".join(words))
        labels.append(label)
    return texts, labels


def hf_data(cfg):
    """A datasets.Dataset, tokenized with .map, padded per batch by DataCollatorWithPadding."""
    import datasets
    from transformers import DataCollatorWithPadding

    datasets.disable_progress_bars()
    tok = tokenizer()

    def split(n, seed):
        texts, labels = reviews(n, seed)
        ds = datasets.Dataset.from_dict({"text": texts, "label": labels})
        ds = ds.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
        return ds.with_format("torch") if cfg.options.get("torch_format") else ds

    return ddplab.Data(
        train=split(256, 0),
        val=split(64, 1),
        task=ddplab.Classification(2, ["negative", "positive"]),
        collate_fn=DataCollatorWithPadding(tok),
        preprocess=lambda text: dict(tok(text)),
    )


def bert(cfg, data):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(WORDS) + 3,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


# ---------------------------------------------------------------------------- streams


class Numbers(torch.utils.data.IterableDataset):
    """Items {x, labels, idx} for idx in range(n), shuffled per epoch when asked; no len(), no state."""

    def __init__(self, n: int, shuffle: bool = True) -> None:
        self.n, self.shuffle, self.epoch = n, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = list(range(self.n))
        if self.shuffle:
            random.Random(self.epoch).shuffle(order)
        for i in order:
            g = torch.Generator().manual_seed(i)
            x = torch.randn(4, generator=g)
            yield {"x": x, "labels": int(x.sum() > 0), "idx": i}


class UnevenShards(Numbers):
    """Shards itself: rank r yields its own shard, of 10 + 7 r items."""

    shards_itself = True

    def __iter__(self):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        base = 1000 * rank
        for i in range(10 + 7 * rank):
            x = torch.randn(4, generator=torch.Generator().manual_seed(base + i))
            yield {"x": x, "labels": int(x.sum() > 0), "idx": base + i}


def stream_data(cfg):
    o = cfg.options
    if o.get("kind") == "uneven":
        train, val = UnevenShards(0), Numbers(37, shuffle=False)
    elif o.get("kind") == "hf":
        import datasets

        def rows(n):
            for item in Numbers(n, shuffle=False):
                yield {**item, "x": item["x"].tolist()}

        full = datasets.Dataset.from_generator(rows, gen_kwargs={"n": o.get("n", 96)})
        train = full.to_iterable_dataset(num_shards=4).shuffle(seed=0, buffer_size=1).with_format("torch")
        val = Numbers(37, shuffle=False)
    elif o.get("kind") == "map":  # the same items, held in memory: what a stream is compared with
        train, val = _Items(list(Numbers(o.get("n", 96), shuffle=False))), Numbers(37, shuffle=False)
    else:
        train, val = Numbers(o.get("n", 96)), Numbers(37, shuffle=False)
    return ddplab.Data(train=train, val=val, task=ddplab.Classification(2))


class Recorder(torch.nn.Module):
    """A linear classifier that writes the idx of every training sample it sees to
    <options.log>/<rank>.<pid>, one line per forward pass, and kills its own process (SIGKILL) at the
    start of training forward pass $DIE_AT + 1 on rank 0 (not an option: a resume needs the same config)."""

    def __init__(self, log: str | None, die_at: int | None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.log, self.die_at, self.passes = log, die_at, 0

    def forward(self, x, labels=None, idx=None):
        if self.training and torch.is_grad_enabled() and self.log:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if self.die_at is not None and rank == 0 and self.passes == self.die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            self.passes += 1
            with open(Path(self.log) / f"{rank}.{os.getpid()}", "a") as f:
                f.write(" ".join(str(int(i)) for i in idx) + "\n")
        return self.linear(x)


def recorder(cfg, data):
    torch.manual_seed(0)
    die_at = os.environ.get("DIE_AT")
    return Recorder(cfg.options.get("log"), int(die_at) if die_at else None)


def bad_data(cfg):
    """What ddplab refuses: options.kind names it."""
    kind = cfg.options.kind
    if kind == "list":
        return ddplab.Data(train=[(torch.zeros(4), 0)] * 8, task=ddplab.Classification(2))
    if kind == "dataset_dict":
        import datasets

        return ddplab.Data(
            train=datasets.DatasetDict({"train": datasets.Dataset.from_dict({"label": [0, 1]})}),
            task=ddplab.Classification(2),
        )
    if kind == "text_left":  # a text column left beside the token ids: the collator cannot pad it
        data = hf_data(cfg)
        data.train = data.train.add_column("review", ["some text"] * len(data.train))
        return data
    raise ValueError(kind)


def per_rank_vocabulary(cfg):
    """A word list in an order of each rank's own, as one built from a set of strings is under plain torchrun
    (each exec'd worker salts its string hashes differently): the ids of the same text differ between ranks."""
    words = sorted({*WORDS})
    random.Random(int(os.environ["RANK"])).shuffle(words)
    vocab = {w: i for i, w in enumerate(words)}
    texts, labels = reviews(32, 0)
    items = [
        ({"input_ids": torch.tensor([vocab[w] for w in t.split()][:2])}, y) for t, y in zip(texts, labels, strict=True)
    ]
    return ddplab.Data(train=items and _Items(items), task=ddplab.Classification(2), meta={"vocab": vocab})


class _Items(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class Bag(torch.nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.EmbeddingBag(vocab, 8), torch.nn.Linear(8, 2)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


def bag(cfg, data):
    return Bag(len(WORDS))


# ---------------------------------------------------------------------------- seq2seq

LETTERS = "abcdefghijklmnopqrstuvwxyz :"  # ids 3...; 0 pads, 1 ends a sequence


def _ids(text: str) -> torch.Tensor:
    return torch.tensor([LETTERS.index(c) + 3 for c in text if c in LETTERS] + [1])


def _text(ids) -> str:
    return "".join(LETTERS[i - 3] for i in ids if i >= 3)


class Reverse(ddplab.Task):
    """A seq2seq task whose predict is the model's generated text."""

    def infer(self, model, inputs):
        return model.generate(**inputs, max_new_tokens=8, do_sample=False)

    def predict(self, output, top_k=1):
        return [{"text": _text(row.tolist())} for row in output]


class PerSample(Reverse):
    """The same task counting no items: its token-mean loss is averaged per process."""

    def items(self, target):
        return None


def _pad(rows: list[torch.Tensor], value: int) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


def seq2seq_collate(items: list[dict]) -> dict:
    """Inputs padded with 0 (masked), labels with -100 (not scored); items without labels (predict) stay so."""
    ids = [item["input_ids"] for item in items]
    batch = {"input_ids": _pad(ids, 0), "attention_mask": _pad([torch.ones_like(i) for i in ids], 0)}
    if "labels" in items[0]:
        batch["labels"] = _pad([item["labels"] for item in items], -100)
    return batch


def seq2seq_data(cfg):
    """ "reverse: WORD" -> the word reversed; words of 1 to 7 letters, so that padding varies between batches.
    options.generates=false: the plain Task, whose predict has no text to give; options.counts=false: a Task that
    counts no items."""
    rng = random.Random(0)
    words = ["".join(rng.choice(LETTERS[:26]) for _ in range(rng.randrange(1, 8))) for _ in range(96)]
    items = [{"input_ids": _ids(f"reverse: {w}"), "labels": _ids(w[::-1])} for w in words]
    return ddplab.Data(
        train=_Items(items[:64]),
        val=_Items(items[64:]),
        task=(Reverse() if cfg.options.get("counts", True) else PerSample())
        if cfg.options.get("generates", True)
        else ddplab.Task(),
        collate_fn=seq2seq_collate,
        preprocess=lambda text: {"input_ids": _ids(text)},
    )


def t5(cfg, data):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=len(LETTERS) + 3,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(config)
