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

import copy
import json
import operator
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
from ddplab.errors import RunError, UserError, first_line
from ddplab.runtime.extras import require


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
        if not hasattr(window, "__index__") or operator.index(window) < 1:
            raise UserError(f"Shards: window must be a whole number of rows, at least 1, not {window!r}")
        self.seed, self.shuffle, self.window = seed, shuffle, window
        self.columns = list(columns) if columns is not None else None
        self.transform = transform
        with ThreadPoolExecutor(8) as pool:  # a remote store answers many requests at once
            self.counts = list(pool.map(lambda f: _count(self.format, *f), self.files))
        if not sum(self.counts):
            raise UserError(f"Shards: the {len(self.files)} {self.format} file(s) at {paths!r} hold no samples")
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
        """The samples at positions start <= j < end of the epoch's global order that data.stream.owns gives this
        rank's loader worker (counting from `start`); only the windows holding them are read."""
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
                    for item in _items(self.format, block, rows, self.files[shard][1], at):
                        yield self.transform(item) if self.transform is not None else item
                at += len(block)
                if first + at >= end:
                    return
            j = firsts[k + 1]


def split_shards(cfg, transform: Callable | None = None) -> tuple[Shards, Shards | None, Shards | None]:
    """The built-in text, text_files and image_folder data streamed (data.stream=true): (train, val, test),
    training in the order of (experiment.seed, epoch), the others in file order; each item through `transform`
    (a split's own may replace it), tokenised or decoded in the loader workers, nothing held whole or cached.
    What the whole-data path learns from every sample comes without a pass over the data: a text classifier's
    labels from the first rows of the training shards, a language model's vocabulary from bytes, an image set's
    classes from data.num_classes."""
    d = cfg.data

    def shards(path: str | None, train: bool) -> Shards | None:
        return None if path is None else Shards(path, seed=cfg.experiment.seed, shuffle=train, transform=transform)

    train = shards(d.train, True)
    assert train is not None  # checks.check_stream: data.stream needs data.train
    return train, shards(d.val, False), shards(d.test, False)


def first_items(shards: Shards, n: int, columns: Sequence[str] | None = None) -> list:
    """The first `n` items of `shards` in file order, as read (no transform)."""
    plain = copy.copy(shards)
    plain.shuffle, plain.transform, plain.columns = False, None, list(columns) if columns is not None else None
    return list(plain.share(0, 0, n, 0, 1, 1, 0, 1))


def check_columns(shards: Shards, path: str, fields: dict[str, str]) -> None:
    """Table shards hold, in their first row, the columns the config names ({"text_column": "text", ...})."""
    row = next(iter(first_items(shards, 1)), None)
    if isinstance(row, dict):
        for field, column in fields.items():
            if column not in row:
                raise UserError(
                    f"data.{field}: {path} has no column '{column}'; its columns: {', '.join(map(str, row))}"
                )


# A shard that cannot be read fails the run naming it and the damaged part (row group, record batch, line, tar
# member): the library's own message names neither.


class DamagedShard(RunError):
    """A shard file that cannot be read as its format says: a failure at run time (exit 1), not bad input."""


def _damaged(fmt: str, path: str, exc: Exception, where: str = "") -> DamagedShard:
    said = first_line(exc, 160) or "(no message)"
    return DamagedShard(f"damaged {fmt} shard {path}{where}: {type(exc).__name__}: {said}")


def _count(fmt: str, fs, path: str) -> int:
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq  # optional: the `text` extra

            with fs.open(path, "rb") as f:
                return pq.ParquetFile(f).metadata.num_rows
        with fs.open(path, "rb", compression="infer") as f:
            if fmt == "arrow":
                return sum(batch.num_rows for batch in _arrow_batches(f, None, path))
            return sum(1 for _ in (_tar_samples(f, path) if fmt == "tar" else _lines(f)))
    except DamagedShard:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever its library raises, the file is what is wrong
        raise _damaged(fmt, path, exc) from exc


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
            yield from _rebatch(_row_groups(pf, range(group, pf.num_row_groups), size, columns, path), at - first, size)
        return
    with fs.open(path, "rb", compression="infer") as f:
        if fmt == "arrow":
            yield from _rebatch(_arrow_batches(f, columns, path), at, size)
            return
        rows = islice(_tar_samples(f, path) if fmt == "tar" else _lines(f), at, None)
        while True:
            try:
                block = list(islice(rows, size))
            except DamagedShard:
                raise
            except Exception as exc:  # noqa: BLE001 - a truncated or corrupt compressed file
                raise _damaged(fmt, path, exc, f" after its first {at} samples") from exc
            if not block:
                return
            yield block
            at += len(block)


def _row_groups(pf, groups: range, size: int, columns, path: str) -> Iterator:
    """The record batches of these row groups, one group at a time: a damaged one is named."""
    for group in groups:
        try:
            batches = list(pf.iter_batches(batch_size=size, row_groups=[group], columns=columns))
        except Exception as exc:  # noqa: BLE001 - whatever pyarrow raises, the row group is what is wrong
            raise _damaged("parquet", path, exc, f" row group {group} of {pf.num_row_groups}") from exc
        yield from batches


def _items(fmt: str, block, rows: np.ndarray, path: str, first: int) -> list:
    """The samples at `rows` of a window whose first row is row `first` of its shard."""
    if fmt in ("parquet", "arrow"):
        return block.take(rows).to_pylist()
    items = []
    for i in rows:
        try:
            if fmt == "json":
                items.append(json.loads(block[i]))
            elif fmt == "text":
                items.append(block[i].decode("utf-8").rstrip("\r\n"))
            else:
                items.append(_tar_item(block[i]))
        except ValueError as exc:  # not JSON, not UTF-8
            raise _damaged(fmt, path, exc, f" sample {first + i} (non-blank line {first + i + 1})") from exc
    return items


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


def _arrow_batches(f, columns, path: str) -> Iterator:
    """The record batches of an Arrow IPC file, or of an IPC stream (as Hugging Face datasets saves)."""
    import pyarrow as pa  # optional: the `text` extra
    import pyarrow.ipc as ipc

    try:
        try:
            reader = ipc.open_file(f)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            f.seek(0)
            batches = iter(ipc.open_stream(f))
    except Exception as exc:  # noqa: BLE001 - neither an IPC file nor a stream: its header or footer is damaged
        raise _damaged("arrow", path, exc) from exc
    index = 0
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:  # noqa: BLE001 - a batch cut short or corrupt
            raise _damaged("arrow", path, exc, f" record batch {index}") from exc
        if batch is None:
            return
        yield batch.select(columns) if columns is not None else batch
        index += 1


def _lines(f) -> Iterator[bytes]:
    return (line for line in f if line.strip())


def _tar_samples(f, path: str) -> Iterator[list]:
    """WebDataset samples: runs of (name, bytes) whose names agree up to the first dot of their base name."""
    with tarfile.open(fileobj=f, mode="r|*") as tar:
        for _, sample in groupby(_tar_files(tar, f, path), key=lambda file: _key_ext(file[0])[0]):
            yield list(sample)


def _tar_files(tar: tarfile.TarFile, f, path: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each regular file, read as it is reached (a streamed tar cannot go back). tarfile takes a
    header cut short for the archive's end, so an uncompressed tar without its end-of-archive block is named."""
    members, last = iter(tar), None
    while True:
        member = None
        try:
            member = next(members, None)
            if member is None:
                if path.lower().endswith(".tar") and f.seek(0, 2) < tar.offset + tarfile.BLOCKSIZE:
                    raise EOFError("the archive stops before its end-of-archive block: it was cut short")
                return
            data = cast(IO[bytes], tar.extractfile(member)).read() if member.isfile() else None
        except (tarfile.TarError, OSError, EOFError) as exc:
            where = f" member {member.name}" if member is not None else f" after member {last}" if last else ""
            raise _damaged("tar", path, exc, where) from exc
        last = member.name
        if data is not None:
            yield member.name, data


def _key_ext(name: str) -> tuple[str, str]:
    """A tar member's sample key and extension: "a/b.seg.png" -> ("a/b", "seg.png")."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return f"{folder}/{stem}" if folder else stem, ext


def _tar_item(sample: list) -> dict:
    return {"__key__": _key_ext(sample[0][0])[0], **{_key_ext(name)[1]: data for name, data in sample}}
