"""Where labelled texts come from, as `datasets.Dataset` splits: the HF hub's (IMDB, Amazon Polarity) and the
user's files, written once into HF's Arrow cache (keyed by their paths, sizes and times).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

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


# ---------------------------------------------------------------------------- hub datasets


@contextlib.contextmanager
def _offline():
    """data.download=false: never touch the network (an unreachable hub costs ~30 s of retries). Both libraries
    read their offline flag at import time; it is flipped for this call only."""
    import datasets  # the text extra, only when a hub dataset is read
    import huggingface_hub.constants as hub  # comes with datasets (the text extra)

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def hub_source(cfg) -> tuple[dict, list[str], None]:
    """The hub's labelled splits under our names, its ClassLabel's names, no label mapping."""
    import datasets  # the text extra, only when a hub dataset is read

    name, fields = HUB[cfg.data.name]
    try:
        with contextlib.nullcontext() if cfg.data.download else _offline():
            ds = datasets.load_dataset(name, cache_dir=cfg.data.cache_dir)
    except Exception as exc:  # noqa: BLE001 - every way of not finding the data gets the same advice
        reason = first_line(exc, 120) or type(exc).__name__
        how = "the hub is unreachable" if cfg.data.download else "data.download=false and it is not in the HF cache"
        raise UserError(
            f"data.name={cfg.data.name}: cannot load '{name}' with datasets.load_dataset ({how}: {reason}); "
            f"run once with data.download=true on a connected machine (data.cache_dir=<folder> to keep it), "
            f"or use data.name=text_files data.train=<csv/json/parquet>"
        ) from None
    names = list(ds["train"].features["label"].names)
    return {ours: ds[theirs] for theirs, ours in HUB_SPLITS.items() if theirs in ds}, names, None


def hub_describe(cfg) -> dict:
    name, fields = HUB[cfg.data.name]
    return {"dataset": name, "fields": fields, "cache_dir": cfg.data.cache_dir}


# ---------------------------------------------------------------------------- the user's files


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
