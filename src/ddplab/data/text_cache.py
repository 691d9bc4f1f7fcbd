"""The on-disk token cache (text_files, synthetic_reviews): tokenise once, every rank memory-maps it read-only.

A cache is a folder `text-<key>/` whose key hashes the data source and the tokenizer
settings. Per split it holds `<split>.ids.npy` (N, max_len) padded ids, `<split>.lengths.npy`
and `<split>.labels.npy`, plus `meta.json` (label names, sizes, tokenizer). It is written
under a temporary name and renamed into place, so a half-written cache is never read.
Ranks hold no token lists of their own: their memory stays flat however large the data.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddplab.errors import UserError

META = "meta.json"
VERSION = 1  # bump when the layout or a tokenizer's output changes
CHUNK = 10_000  # texts tokenised per write


@dataclass
class TextSplit:
    """One split of raw data: its size and a reader of (texts, label ids) chunks."""

    size: int
    chunks: Callable[[int], Iterator[tuple[list[str], np.ndarray]]]


@dataclass
class TextSource:
    splits: dict[str, TextSplit]
    label_names: list[str]


def cache_folder(root: str | Path, description: dict) -> Path:
    blob = json.dumps({"version": VERSION, **description}, sort_keys=True, default=str)
    return Path(root) / f"text-{hashlib.sha256(blob.encode()).hexdigest()[:20]}"


def is_complete(folder: Path) -> bool:
    return (folder / META).is_file()


def cache_root(cfg) -> Path:
    """Where caches live: data.cache_dir, else <output_dir>/.cache."""
    return Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.experiment.output_dir) / ".cache"


@contextlib.contextmanager
def building(folder: Path) -> Iterator[Path]:
    """A temporary folder that becomes `folder` once written (meta.json last), so a half-written
    cache is never read. The image cache builds through it too."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.replace(tmp, folder)
        except OSError:
            if not is_complete(folder):  # another node's builder won the race: its copy serves as well
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def npy_offset(path: Path, dtype, shape: tuple) -> int:
    """Create an .npy file and return where its rows start. The rows then go through a plain file
    handle, so the writer does not keep the whole array resident in its own address space."""
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape).offset


def write(folder: Path, source: TextSource, tokenizer, description: dict, log: Callable[[str], None] = print) -> None:
    """Tokenise every split of `source` into `folder`, atomically."""
    with building(folder) as tmp:
        sizes = {}
        for name, split in source.splits.items():
            sizes[name] = _write_split(tmp, name, split, tokenizer)
            log(f"token cache: {name} split, {sizes[name]} texts tokenised")
        meta = {
            "label_names": source.label_names,
            "sizes": sizes,
            "tokenizer": tokenizer.describe(),
            "source": description,
            "dtype": tokenizer.dtype.name,
            "version": VERSION,
        }
        (tmp / META).write_text(json.dumps(meta, indent=1))


def _write_split(folder: Path, name: str, split: TextSplit, tokenizer) -> int:
    n = split.size
    fields = {"ids": (tokenizer.dtype, (n, tokenizer.max_len)), "lengths": (np.int32, (n,)), "labels": (np.int64, (n,))}
    headers = {field: npy_offset(folder / f"{name}.{field}.npy", *spec) for field, spec in fields.items()}
    row = 0
    with contextlib.ExitStack() as files:
        handles = {field: files.enter_context(open(folder / f"{name}.{field}.npy", "r+b")) for field in headers}
        for texts, labels in split.chunks(CHUNK):
            ids, lengths = tokenizer.encode_batch(texts)
            if row + len(texts) > n:
                raise RuntimeError(f"the {name} split yielded more than its {n} rows")
            for field, block in (("ids", ids), ("lengths", lengths), ("labels", np.asarray(labels, dtype=np.int64))):
                f = handles[field]
                f.seek(headers[field] + row * block[0:1].nbytes)
                f.write(np.ascontiguousarray(block).tobytes())
            row += len(texts)
    if row != n:
        raise RuntimeError(f"the {name} split yielded {row} rows, expected {n}")
    return n


def ensure(ctx, folder: Path | None, build: Callable[[], None], what: str = "token cache") -> None:
    """Rank 0 builds a cache folder (complete once its meta.json exists) if it is missing while
    the others wait; errors reach every rank. Without a filesystem shared across nodes, each
    other node's first rank then builds its own copy. The image cache uses it too. folder=None:
    every rank runs `build`, one rank a node first, the others after it (reusing what it cached)."""
    done = lambda: folder is not None and is_complete(folder)  # noqa: E731
    if ctx is None:  # built outside a job (tests, predict): no one to wait for
        if not done():
            build()
        return
    for builder in (ctx.is_main, not ctx.is_main and ctx.local_rank == 0):
        error, failure = None, None
        if builder and not done():
            try:
                build()
            except UserError as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - the others must not wait forever for a crashed rank 0
                error = f"building the {what} failed on rank {ctx.rank}: {type(exc).__name__}: {exc}"
                failure = exc
        errors = [e for e in ctx.gather_objects(error) if e]  # also the barrier the others wait at
        if failure is not None:
            raise failure  # a bug keeps its traceback where it happened
        if errors:
            raise UserError(errors[0])
    if folder is None:
        return None if ctx.is_main or ctx.local_rank == 0 else build()
    blind = [r for r in ctx.gather_objects(None if done() else ctx.rank) if r is not None]
    if blind:
        raise UserError(
            f"{what} {folder} was built but rank(s) {blind} cannot see it: the processes of a "
            f"node must share one experiment.output_dir (or data.cache_dir)"
        )


class TokenCache:
    """Read-only view of a complete cache. Opened lazily, so pickling it (DataLoader workers)
    sends a path, not the arrays."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / META).read_text())
        self._arrays: dict[str, np.ndarray] = {}

    def array(self, split: str, field: str) -> np.ndarray:
        key = f"{split}.{field}"
        if key not in self._arrays:
            self._arrays[key] = np.load(self.folder / f"{key}.npy", mmap_mode="r")
        return self._arrays[key]

    def size(self, split: str) -> int:
        return self.meta["sizes"].get(split, 0)

    def __getstate__(self) -> dict:
        return {"folder": self.folder, "meta": self.meta, "_arrays": {}}
