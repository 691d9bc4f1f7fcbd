"""`synthetic_reviews`: generated, learnable movie-review-like texts for smoke runs and benchmarks.

Each review is 40-160 words of neutral film vocabulary; about 10 % of its words come from its class's sentiment
lexicon and 2.5 % from another class's (a bag-of-words naive Bayes classifier scores about 97.7 % on two
classes). Generation is seeded per block of rows: any size streams with flat memory, the same every time.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ddplab.data.text_cache import cache_root

POSITIVE = (
    "great excellent wonderful superb brilliant enjoyable moving delightful masterpiece fantastic "
    "charming beautiful gripping touching hilarious stunning memorable clever"
).split()
NEGATIVE = (
    "awful terrible boring dull horrible weak poor dreadful mess disappointing tedious painful "
    "clumsy forgettable pointless bland annoying predictable"
).split()
# Extra lexicons for more than two classes (rating-like labels).
EXTRA = (
    "decent okay fine average passable watchable solid competent uneven mixed modest fair "
    "ambitious odd quirky strange daring bold"
).split()
NEUTRAL = (
    "the a an and of to in is it that this film movie story plot scene scenes actor actors actress "
    "director character characters cast script camera music score ending beginning end time "
    "was were has have had with as for on at by from his her their its one two first last "
    "very quite rather really just also even still again then when while where who which "
    "about into over after before through during between some many most more less other such "
    "only own same so than too can will would could should may might must do does did "
    "make made makes see seen watch watched look looks feel feels felt think thought "
    "year years minute minutes hour part role roles audience viewers people man woman "
    "world life love family friend house city night day home war truth death money job "
    "dialogue performance performances effects action drama comedy thriller horror romance "
    "sequel version book novel series episode screen theater theatre studio production "
    "lead supporting young old new long short big small whole entire second third final"
).split()

P_SIGNAL, P_NOISE = 0.10, 0.025
VERSION = 1  # in the cache key: bump when the generated texts change
CHUNK = 10_000  # reviews generated at a time
BLOCK = 1000  # rows share a random stream per block, so any row range is reproducible


def lexicons(num_classes: int) -> list[list[str]]:
    if num_classes == 2:
        return [NEGATIVE, POSITIVE]
    pool = NEGATIVE + POSITIVE + EXTRA
    size = len(pool) // num_classes  # at least 3: data.checks.check_text_classes bounds data.num_classes
    return [pool[c * size : (c + 1) * size] for c in range(num_classes)]


def generate(seed: int, start: int, count: int, num_classes: int) -> tuple[list[str], np.ndarray]:
    """Reviews start .. start+count-1; chunk-aligned calls give the same rows whatever the chunking."""
    first = start // BLOCK
    blocks = [_block(seed, b, num_classes) for b in range(first, (start + count - 1) // BLOCK + 1)]
    at = slice(start - first * BLOCK, start - first * BLOCK + count)
    return [t for texts, _ in blocks for t in texts][at], np.concatenate([labels for _, labels in blocks])[at]


def _block(seed: int, b: int, num_classes: int, size: int = BLOCK) -> tuple[list[str], np.ndarray]:
    rng = np.random.default_rng([seed, b])
    lex = lexicons(num_classes)
    vocab = np.array(NEUTRAL + [w for words in lex for w in words] + [".", ","], dtype=object)
    offsets = np.cumsum([len(NEUTRAL)] + [len(w) for w in lex])  # start of each class's lexicon
    labels = rng.integers(0, num_classes, size)
    lengths = rng.integers(40, 161, size)
    total = int(lengths.sum())
    # Neutral words follow a Zipf-like law, as real text does.
    zipf = 1.0 / np.arange(1, len(NEUTRAL) + 1)
    words = rng.choice(len(NEUTRAL), total, p=zipf / zipf.sum())
    row_of = np.repeat(np.arange(size), lengths)
    draw = rng.random(total)
    own = labels[row_of]
    other = (own + rng.integers(1, num_classes, total)) % num_classes
    cls = np.where(draw < P_SIGNAL, own, np.where(draw < P_SIGNAL + P_NOISE, other, -1))
    sizes = np.array([len(w) for w in lex])
    pick = offsets[np.maximum(cls, 0)] + (rng.random(total) * sizes[np.maximum(cls, 0)]).astype(np.int64)
    words = np.where(cls >= 0, pick, words)
    punct = rng.random(total)
    ends = np.cumsum(lengths)
    punct[ends - lengths] = 1.0  # no review opens with a punctuation mark
    words = np.where(punct < 0.07, len(vocab) - 2, np.where(punct < 0.10, len(vocab) - 1, words))
    tokens = vocab[words]
    texts = [
        " ".join(tokens[end - n : end]).replace(" .", ".").replace(" ,", ",").capitalize() + "."
        for end, n in zip(ends, lengths, strict=True)
    ]
    return texts, labels


def _rows(seed: int, num_samples: int, num_classes: int, key: dict) -> Iterator[dict]:
    """The reviews as {text, label}; `key` (describe's) only keys the cache."""
    for start in range(0, num_samples, CHUNK):
        texts, labels = generate(seed, start, min(CHUNK, num_samples - start), num_classes)
        yield from ({"text": t, "label": int(y)} for t, y in zip(texts, labels, strict=True))


def source(cfg) -> tuple[dict, list[str], None]:
    """One train split as a `datasets.Dataset` of {text, label}, the label names, no label mapping."""
    import datasets  # the text extra

    n, seed, k = cfg.data.num_samples, cfg.experiment.seed, cfg.data.num_classes or 2
    names = ["negative", "positive"] if k == 2 else [f"rating_{c + 1}" for c in range(k)]
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names)})
    train = datasets.Dataset.from_generator(
        _rows,
        features=features,
        gen_kwargs={"seed": seed, "num_samples": n, "num_classes": k, "key": describe(cfg)},
        cache_dir=str(cache_root(cfg)),
    )
    return {"train": train}, names, None


def describe(cfg) -> dict:
    return {
        "dataset": "synthetic_reviews",
        "seed": cfg.experiment.seed,
        "num_samples": cfg.data.num_samples,
        "num_classes": cfg.data.num_classes or 2,
        "p_signal": P_SIGNAL,
        "p_noise": P_NOISE,
        "version": VERSION,
    }
