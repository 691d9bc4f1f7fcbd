"""`Shards`: a stream read from files bigger than memory (Parquet, Arrow, JSON lines, text, WebDataset
tar), local or at any fsspec URL, whose sample order is a function of (seed, epoch) alone.

The global order of an epoch: the shards in an order drawn from (seed, epoch), each shard cut into
consecutive windows of `window` rows, the rows of each window in an order drawn from (seed, epoch,
shard, window). Position j of that order is found from the shards' row counts without reading
anything before it, so each rank and loader worker reads only the windows that hold its share (see
data.stream.owns), from any position: a run resumed at another world size or worker count goes on
at the exact next global sample, having read at most one window of a shard (text, JSON lines and
tar are read past, not decoded, up to the window; Parquet seeks to its row group).

Shuffle quality: a sample moves at most `window - 1` places within its shard, and the shards come
in a random order; so consecutive batches come from one shard. Shards that each hold a mix of the
data (as written by most pipelines) train as well as a full shuffle; shards sorted by label or by
source do not: shuffle the rows before writing them, or make `window` as large as a shard.
"""

from __future__ import annotations

import json
import tarfile
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby, islice
from typing import IO, cast

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from ddplab.data.shard_files import FORMATS, expand, format_of
from ddplab.data.stream import owns
from ddplab.errors import UserError
from ddplab.extras import require


class Shards(IterableDataset):
    """Samples from shard files, read a window at a time; its len() is the number of samples.

    paths: a file, a folder (every file under it of the format), a glob, or a list of them; local
    paths or fsspec URLs (s3://, gs://, hf://, https://, ...), opened with `storage_options`.
    format: "parquet", "arrow", "json" (JSON lines), "text" (one sample a line) or "tar" (WebDataset:
    the files of one sample share a name up to its first dot); by default from the file names.
    Items: a dict of the columns (Parquet, Arrow, JSON lines: `columns` picks them), a line of text
    (str, blank lines skipped), or a dict {"__key__": name, extension: bytes} (tar); `transform`,
    if given, is applied to each (it runs in the loader workers: decode, tokenize there).
    """

    def __init__(
        self,
        paths,
        format: str | None = None,
        *,
        seed: int = 0,
        shuffle: bool = True,
        window: int = 10_000,
        columns: Sequence[str] | None = None,
        transform: Callable | None = None,
        storage_options: dict | None = None,
    ) -> None:
        require("text", "ddplab.Shards", ("fsspec", "pyarrow"))
        self.files = expand(paths, format, storage_options or {})
        if not self.files:
            raise UserError(f"Shards: no {format or 'shard'} files at {paths!r}")
        formats = {format or format_of(path) for _, path in self.files}
        named = [f for f in formats if f is not None]
        if len(formats) != 1 or not named:
            raise UserError(
                f"Shards: cannot tell one format ({', '.join(sorted(set(FORMATS.values())))}) from the "
                f"files at {paths!r}: give format="
            )
        self.format: str = named[0]
        if window < 1:
            raise UserError(f"Shards: window must be at least 1, not {window}")
        self.seed, self.shuffle, self.window = seed, shuffle, window
        self.columns = list(columns) if columns is not None else None
        self.transform = transform
        with ThreadPoolExecutor(8) as pool:  # a remote store answers many requests at once
            self.counts = list(pool.map(lambda f: _count(self.format, *f), self.files))
        self.epoch = 0

    def __len__(self) -> int:
        return sum(self.counts)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator:
        """The epoch's global order (in a DataLoader's workers, each takes every workers-th sample)."""
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        return self.share(self.epoch, 0, None, 0, 1, 1, worker, workers)

    def order(self, epoch: int) -> list[int]:
        """The shards (indices into self.files) in the order epoch `epoch` reads them."""
        if not self.shuffle:
            return list(range(len(self.files)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.files)).tolist()

    def share(
        self,
        epoch: int,
        start: int,
        end: int | None,
        rank: int,
        world_size: int,
        batch_size: int,
        worker: int,
        workers: int,
    ) -> Iterator:
        """The samples at positions start <= j < end of the epoch's global order that data.stream.owns gives
        this rank's loader worker (counting from `start`, as a DataLoader's workers take turns from the
        first batch it yields), in order; only the windows holding them are read."""
        order = self.order(epoch)
        firsts = np.cumsum([0] + [self.counts[s] for s in order]).tolist()  # global position of each shard's first
        end = firsts[-1] if end is None else min(end, firsts[-1])
        j = start
        while j < end:
            k = bisect_right(firsts, j) - 1
            shard, first = order[k], firsts[k]
            at = (j - first) // self.window * self.window  # the window holding position j, in the shard
            for block in _windows(self.format, *self.files[shard], at, self.window, self.columns):
                where = np.arange(max(j, first + at), min(first + at + len(block), end))
                where = where[owns(where - start, rank, world_size, batch_size, worker, workers)]
                if len(where):
                    rows = where - first - at
                    if self.shuffle:  # the window's rows in an order drawn from (seed, epoch, shard, window)
                        drawn = np.random.default_rng([self.seed, epoch, shard, at // self.window])
                        rows = drawn.permutation(len(block))[rows]
                    for item in _items(self.format, block, rows):
                        yield self.transform(item) if self.transform is not None else item
                at += len(block)
                if first + at >= end:
                    return
            j = firsts[k + 1]


# ---------------------------------------------------------------------------- formats
# Each format counts a shard's samples, reads it in windows from any window's first row, and makes
# the samples of a window's chosen rows.


def _count(fmt: str, fs, path: str) -> int:
    if fmt == "parquet":
        import pyarrow.parquet as pq  # optional: the `text` extra

        with fs.open(path, "rb") as f:
            return pq.ParquetFile(f).metadata.num_rows
    with fs.open(path, "rb", compression="infer") as f:
        if fmt == "arrow":
            return sum(batch.num_rows for batch in _arrow_batches(f, None))
        return sum(1 for _ in (_tar_samples(f) if fmt == "tar" else _lines(f)))


def _windows(fmt: str, fs, path: str, at: int, size: int, columns) -> Iterator:
    """Windows of `size` rows (the last may be shorter) of one shard, from row `at` on."""
    if fmt == "parquet":
        import pyarrow.parquet as pq  # optional: the `text` extra

        with fs.open(path, "rb") as f:
            pf = pq.ParquetFile(f)
            group, first = 0, 0
            while group < pf.num_row_groups and first + pf.metadata.row_group(group).num_rows <= at:
                first += pf.metadata.row_group(group).num_rows
                group += 1
            batches = pf.iter_batches(batch_size=size, row_groups=range(group, pf.num_row_groups), columns=columns)
            yield from _rebatch(batches, at - first, size)
        return
    with fs.open(path, "rb", compression="infer") as f:
        if fmt == "arrow":
            yield from _rebatch(_arrow_batches(f, columns), at, size)
            return
        rows = islice(_tar_samples(f) if fmt == "tar" else _lines(f), at, None)
        while block := list(islice(rows, size)):
            yield block


def _items(fmt: str, block, rows: np.ndarray) -> list:
    if fmt in ("parquet", "arrow"):
        return block.take(rows).to_pylist()
    if fmt == "json":
        return [json.loads(block[i]) for i in rows]
    if fmt == "text":
        return [block[i].decode("utf-8").rstrip("\r\n") for i in rows]
    return [_tar_item(block[i]) for i in rows]


def _rebatch(batches, skip: int, size: int) -> Iterator:
    """Arrow tables of `size` rows from record batches of any size, after the first `skip` rows."""
    import pyarrow as pa  # optional: the `text` extra

    pending, have = [], 0
    for batch in batches:
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        batch, skip = batch.slice(skip), 0
        pending.append(batch)
        have += batch.num_rows
        while have >= size:
            table = pa.Table.from_batches(pending, schema=batch.schema)
            yield table.slice(0, size)
            pending, have = table.slice(size).to_batches(), have - size
    if have:
        yield pa.Table.from_batches(pending)


def _arrow_batches(f, columns) -> Iterator:
    """The record batches of an Arrow IPC file, or of an IPC stream (as Hugging Face datasets saves)."""
    import pyarrow as pa  # optional: the `text` extra
    import pyarrow.ipc as ipc

    try:
        reader = ipc.open_file(f)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        f.seek(0)
        batches = iter(ipc.open_stream(f))
    for batch in batches:
        yield batch.select(columns) if columns is not None else batch


def _lines(f) -> Iterator[bytes]:
    return (line for line in f if line.strip())


def _tar_samples(f) -> Iterator[list]:
    """WebDataset samples: runs of files whose names agree up to the first dot of their base name,
    each a list of (name, bytes)."""
    with tarfile.open(fileobj=f, mode="r|*") as tar:
        # Each regular file (extractfile gives None only for others) is read as it is reached: a streamed
        # tar cannot go back to it.
        files = ((m.name, cast(IO[bytes], tar.extractfile(m)).read()) for m in tar if m.isfile())
        for _, sample in groupby(files, key=lambda file: _key_ext(file[0])[0]):
            yield list(sample)


def _key_ext(name: str) -> tuple[str, str]:
    """A tar member's sample key and extension: "a/b.seg.png" -> ("a/b", "seg.png")."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return f"{folder}/{stem}" if folder else stem, ext


def _tar_item(sample: list) -> dict:
    return {"__key__": _key_ext(sample[0][0])[0], **{_key_ext(name)[1]: data for name, data in sample}}
