"""Tokenizers for text classification, each rebuilt from the dict it describes itself with (kept for inference)."""

from __future__ import annotations

import re
import zlib

from ddplab.errors import UserError
from ddplab.models.checks import cannot_load

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
        self.pad_id = self.PAD
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
