"""Which shard files a path names and what format each is in, without torch: `ddplab.Shards` reads
them, and the launcher checks a streamed built-in's paths (data.stream) before any worker starts."""

from __future__ import annotations

import os
from typing import Any

FORMATS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
    ".txt": "text",
    ".text": "text",
    ".tar": "tar",
}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")


def format_of(path: str) -> str | None:
    """The format a file's name says (a compression suffix set aside), or None."""
    stem, ext = os.path.splitext(path.lower())
    return FORMATS.get(os.path.splitext(stem)[1] if ext in COMPRESSED else ext)


def expand(paths, format: str | None, storage_options: dict) -> list[tuple[Any, str]]:
    """(filesystem, path) of every shard, sorted within each of `paths`: a file, a folder (its files of
    the format, given or any the names say), a glob, or a list of them; local or fsspec URLs."""
    import fsspec  # optional: the `text` extra

    files = []
    for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        fs, root = fsspec.core.url_to_fs(os.fspath(path), **storage_options)
        if fs.isdir(root):
            found = [p for p in fs.find(root) if format_of(p) is not None and format_of(p) == (format or format_of(p))]
        elif any(c in root for c in "*?["):
            found = fs.glob(root)
        else:
            found = [root]
        files += [(fs, p) for p in sorted(found)]
    return files
