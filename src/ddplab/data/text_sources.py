"""Where labelled texts come from, as `datasets.Dataset` splits: the HF hub's (IMDB, Amazon Polarity), the user's
files, written once into HF's Arrow cache (keyed by their paths, sizes and times), and `synthetic_reviews`.

`synthetic_reviews`: generated, learnable movie-review-like texts for smoke runs and benchmarks. Each review is 40-160
words of neutral film vocabulary; about 10 % of its words come from its class's sentiment lexicon and 2.5 % from
another class's (a bag-of-words naive Bayes classifier scores about 97.7 % on two classes). Generation is seeded per
block of rows: any size streams with flat memory, the same every time.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ddplab.data.text_cache import cache_root
from ddplab.errors import UserError, first_line

# data.name -> (hub name, text fields joined into one text)
HUB = {
    "imdb": ("stanfordnlp/imdb", ("text",)),
    "amazon_polarity": ("fancyzhx/amazon_polarity", ("title", "content")),
}
HUB_SPLITS = {"train": "train", "validation": "val", "test": "test"}  # IMDB's "unsupervised" has no labels
SUFFIXES = (".csv", ".tsv", ".json", ".jsonl", ".parquet", ".pq")
SMALL = 20 * 2**20  # files up to this size get their labels checked before launch


def hub_source(cfg) -> tuple[dict, list[str], None]:
    """The hub's labelled splits under our names, its ClassLabel's names, no label mapping."""
    import datasets  # the text extra, only when a hub dataset is read
    import huggingface_hub.constants as hub  # comes with datasets (the text extra)

    name, fields = HUB[cfg.data.name]
    # data.download=false: never touch the network (an unreachable hub costs ~30 s of retries). Both libraries read
    # their offline flag at import time; it is flipped for this call only.
    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    if not cfg.data.download:
        datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        ds = datasets.load_dataset(name, cache_dir=cfg.data.cache_dir)
    except Exception as exc:  # noqa: BLE001 - every way of not finding the data gets the same advice
        reason = first_line(exc, 120) or type(exc).__name__
        how = "the hub is unreachable" if cfg.data.download else "data.download=false and it is not in the HF cache"
        raise UserError(
            f"data.name={cfg.data.name}: cannot load '{name}' with datasets.load_dataset ({how}: {reason}); "
            f"run once with data.download=true on a connected machine (data.cache_dir=<folder> to keep it), "
            f"or use data.name=text_files data.train=<csv/json/parquet>"
        ) from None
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved
    names = list(ds["train"].features["label"].names)
    return {ours: ds[theirs] for theirs, ours in HUB_SPLITS.items() if theirs in ds}, names, None


def hub_describe(cfg) -> dict:
    name, fields = HUB[cfg.data.name]
    return {"dataset": name, "fields": fields, "cache_dir": cfg.data.cache_dir}


def _files(cfg) -> dict[str, str]:
    d = cfg.data
    return {split: path for split, path in (("train", d.train), ("val", d.val), ("test", d.test)) if path is not None}


def read_table(path: str | Path, columns: list[str] | None = None, nrows: int | None = None):
    import pandas as pd  # the text extra, only when a table is read

    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".csv", ".tsv"):
        sep = "\t" if suffix == ".tsv" else ","
        return pd.read_csv(p, sep=sep, usecols=columns, keep_default_na=False, na_values=[""], nrows=nrows)
    if suffix in (".parquet", ".pq"):
        return pd.read_parquet(p, columns=columns)
    try:
        frame = pd.read_json(p, lines=suffix == ".jsonl")
    except ValueError:
        frame = pd.read_json(p, lines=suffix != ".jsonl")
    return frame[columns] if columns else frame


def header(path: str | Path) -> list[str] | None:
    """Column names, read cheaply (None where that would mean reading a large JSON file)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".csv", ".tsv"):
        return list(read_table(p, nrows=0).columns)
    if suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq  # the text extra, only for Parquet

        return list(pq.read_schema(p).names)
    if suffix == ".jsonl":
        with open(p, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "{}")
        return list(json.loads(first))
    return list(read_table(p).columns) if p.stat().st_size <= SMALL else None


def check_files(cfg) -> None:
    """Missing files, unknown formats, missing columns, and (for small files) labels that do not fit."""
    d = cfg.data
    if d.train is None:
        raise UserError(
            "data.name=text_files needs data.train=<file> (CSV, TSV, JSON, JSONL or Parquet); "
            "data.val and data.test are optional"
        )
    files = _files(cfg)
    for split, path in files.items():
        p = Path(path)
        if not p.is_file():
            raise UserError(f"data.{split}: no such file: {path}")
        if p.suffix.lower() not in SUFFIXES:
            raise UserError(f"data.{split}: {path} is not one of {', '.join(SUFFIXES)}")
        with _unreadable(split, path):
            columns = header(p)
        if columns is None:
            continue
        for field, column in (("text_column", d.text_column), ("label_column", d.label_column)):
            if column not in columns:
                raise UserError(
                    f"data.{field}: {path} has no column '{column}'; its columns: {', '.join(map(str, columns))}"
                )
    if sum(Path(p).stat().st_size for p in files.values()) <= SMALL:
        parts = []
        for split, path in files.items():
            with _unreadable(split, path):
                parts.append(read_table(path, [d.label_column])[d.label_column])
            if not len(parts[-1]):
                raise UserError(f"data.{split}: {path} holds no rows")
        label_mapping(parts, d.num_classes, d.label_column)


@contextlib.contextmanager
def _unreadable(split: str, path: str):
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - any parse failure is the file's, not ours
        raise UserError(f"data.{split}: cannot read {path}: {first_line(exc, 160) or type(exc).__name__}") from None


def _class_ids(labels) -> bool:
    """Integer labels are class ids (booleans, which pandas counts as integers, are names)."""
    import pandas as pd  # the text extra, only when a table is read

    return pd.api.types.is_integer_dtype(labels) and not pd.api.types.is_bool_dtype(labels)


def label_mapping(parts: list, num_classes: int | None, column: str) -> tuple[list[str], dict | None]:
    """Label names, and a value -> id mapping for non-integer labels (None: the values are the ids)."""
    import pandas as pd  # the text extra, only when a table is read

    labels = pd.concat(parts)
    if labels.isna().any():
        raise UserError(f"data.label_column '{column}' has empty values; every row needs a label")
    if _class_ids(labels):
        low, high = int(labels.min()), int(labels.max())
        k = num_classes or high + 1
        if k < 2:
            raise UserError(
                f"data.label_column '{column}' holds only label {high}; a classifier needs at least 2 classes"
            )
        if low < 0 or high >= k:
            bad = low if low < 0 else high
            raise UserError(
                f"data.label_column '{column}': label {bad} does not fit data.num_classes={k} "
                f"(integer labels are class ids 0..{k - 1}); set data.num_classes or fix the labels"
            )
        return [str(i) for i in range(k)], None
    names = sorted(str(v) for v in labels.astype(str).unique())
    if num_classes is not None and len(names) > num_classes:
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        raise UserError(
            f"data.label_column '{column}' holds {len(names)} distinct labels ({shown}) "
            f"but data.num_classes={num_classes}"
        )
    if len(names) < 2 and num_classes is None:
        raise UserError(
            f"data.label_column '{column}' holds a single label ({names[0]}); a classifier needs at least 2"
        )
    return names, {name: i for i, name in enumerate(names)}


def _rows(path: str, text: str, label: str, stamp: tuple) -> Iterator[dict]:
    """A file's rows as {text, label}: integer labels as read, others as strings. `stamp` only keys the cache."""
    import pandas as pd  # the text extra, only when a table is read

    frame = read_table(path, [text, label])
    labels = frame[label]
    values = labels.tolist() if _class_ids(labels) else [None if pd.isna(y) else str(y) for y in labels]
    for t, y in zip(frame[text].fillna("").astype(str), values, strict=True):
        yield {"text": t, "label": y}


def files_source(cfg) -> tuple[dict, list[str], dict | None]:
    """data.train (+ val, test) of {text, label}, the label names, and the mapping of non-integer labels."""
    import datasets  # the text extra
    import pandas as pd

    d = cfg.data
    check_files(cfg)
    splits = {
        split: datasets.Dataset.from_generator(
            _rows,
            gen_kwargs={"path": path, "text": d.text_column, "label": d.label_column, "stamp": tuple(stamp)},
            cache_dir=str(cache_root(cfg)),
        )
        for split, (path, *stamp) in files_describe(cfg)["files"].items()
    }
    distinct = [pd.Series(s.unique("label")) for s in splits.values() if len(s)]
    names, mapping = label_mapping(distinct, d.num_classes, d.label_column)
    return splits, names, mapping


def files_describe(cfg) -> dict:
    d = cfg.data
    files = {}
    for split, path in _files(cfg).items():
        st = Path(path).stat()
        files[split] = [str(Path(path).resolve()), st.st_size, st.st_mtime_ns]
    return {
        "dataset": "text_files",
        "files": files,
        "text_column": d.text_column,
        "label_column": d.label_column,
        "num_classes": d.num_classes,
    }


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
SYNTHETIC_VERSION = 1  # in the cache key: bump when the generated texts change
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


def _synthetic_rows(seed: int, num_samples: int, num_classes: int, key: dict) -> Iterator[dict]:
    """The reviews as {text, label}; `key` (describe's) only keys the cache."""
    for start in range(0, num_samples, CHUNK):
        texts, labels = generate(seed, start, min(CHUNK, num_samples - start), num_classes)
        yield from ({"text": t, "label": int(y)} for t, y in zip(texts, labels, strict=True))


def synthetic_source(cfg) -> tuple[dict, list[str], None]:
    """One train split as a `datasets.Dataset` of {text, label}, the label names, no label mapping."""
    import datasets  # the text extra

    n, seed, k = cfg.data.num_samples, cfg.experiment.seed, cfg.data.num_classes or 2
    names = ["negative", "positive"] if k == 2 else [f"rating_{c + 1}" for c in range(k)]
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names)})
    train = datasets.Dataset.from_generator(
        _synthetic_rows,
        features=features,
        gen_kwargs={"seed": seed, "num_samples": n, "num_classes": k, "key": synthetic_describe(cfg)},
        cache_dir=str(cache_root(cfg)),
    )
    return {"train": train}, names, None


def synthetic_describe(cfg) -> dict:
    return {
        "dataset": "synthetic_reviews",
        "seed": cfg.experiment.seed,
        "num_samples": cfg.data.num_samples,
        "num_classes": cfg.data.num_classes or 2,
        "p_signal": P_SIGNAL,
        "p_noise": P_NOISE,
        "version": SYNTHETIC_VERSION,
    }
