"""What the data was: a snapshot part (`data_identity`), so that a resume over other data is told, not
trained through. Each split's kind and length, the files it reads (ddplab.Shards: its shards and their
sample counts; another dataset: the files and folders its attributes name, with their sizes in bytes) and a
digest of its first items (a stream that shards itself: each rank's own)."""

from __future__ import annotations

import os
from pathlib import Path

from ddplab.data.stream import is_stream, shards_itself, size
from ddplab.engine.loop.setup import SPLITS, first_items

FILES_SHOWN = 3  # files named in the line that refuses a resume; the rest are counted


def files_of(dataset) -> dict[str, int]:
    """The files a dataset reads, each with its size: a Shards' shards and their samples; else the local files
    its attributes name (a path, a folder, a list of them), in bytes."""
    if dataset is None:
        return {}
    if callable(getattr(dataset, "share", None)) and hasattr(dataset, "files"):  # ddplab.Shards
        return {path: int(n) for (_, path), n in zip(dataset.files, dataset.counts, strict=True)}
    out: dict[str, int] = {}
    for value in vars(dataset).values() if hasattr(dataset, "__dict__") else ():
        values = value if isinstance(value, (list, tuple)) and len(value) < 100_000 else [value]
        for v in values:
            if not isinstance(v, (str, os.PathLike)) or isinstance(v, str) and (len(v) > 4096 or "\n" in v):
                continue
            path = Path(v)
            try:
                if path.is_file():
                    out[str(path)] = path.stat().st_size
                elif path.is_dir():
                    out.update({str(f): f.stat().st_size for f in sorted(path.iterdir()) if f.is_file()})
            except OSError:  # a name too long, a folder unreadable: not a file this dataset reads
                continue
    return out


def describe(dataset) -> dict:
    first = first_items(dataset, 2)[0] if is_stream(dataset) else None  # map-style: the data checks compared them
    return {
        "kind": type(dataset).__name__,
        "size": size(dataset),
        "files": files_of(dataset),
        "first": first,
        "own": shards_itself(dataset),
    }


class DataIdentity:
    """Made once as the run starts (a collective: every rank's description is gathered); state_dict() is what
    the snapshot holds, load_state_dict() keeps the snapshot's for changes()."""

    def __init__(self, data, ctx) -> None:
        mine = {split: describe(getattr(data, split)) for split in SPLITS if getattr(data, split) is not None}
        self.now = ctx.gather_objects(mine)
        self.saved: list | None = None

    def state_dict(self) -> dict:
        return {"ranks": self.now}

    def load_state_dict(self, state: dict) -> None:
        self.saved = state["ranks"]

    def changes(self) -> str:
        """What differs between the snapshot's data and this run's, in words ('' where nothing does). Every
        rank's view is compared at the same world size; at another, rank 0's, and a stream that shards itself
        has other first items by right."""
        if not self.saved:
            return ""
        same = len(self.saved) == len(self.now)
        said: list[str] = []
        for rank in range(len(self.now)) if same else [0]:
            for split, was in self.saved[rank].items():
                now = self.now[rank].get(split)
                found = ["it is gone"] if now is None else _split_changes(was, now)
                if now is not None and not found and was["first"] != now["first"] and (same or not was["own"]):
                    found = ["its first items differ"]
                if found and (line := f"Data.{split}: {', '.join(found)}") not in said:
                    said.append(line)
        return "; ".join(said)


def _split_changes(was: dict, now: dict) -> list[str]:
    out = []
    if was["kind"] != now["kind"]:
        out.append(f"a {now['kind']} where it was a {was['kind']}")
    if was["size"] != now["size"]:
        out.append(f"its length {was['size']} -> {now['size']}")
    gone = [Path(f).name for f in was["files"] if f not in now["files"]]
    new = [Path(f).name for f in now["files"] if f not in was["files"]]
    resized = [
        f"{Path(f).name} {n} -> {now['files'][f]}" for f, n in was["files"].items() if now["files"].get(f, n) != n
    ]
    for what, names in (("gone", gone), ("new", new), ("resized", resized)):
        if names:
            shown = ", ".join(names[:FILES_SHOWN])
            more = f" and {len(names) - FILES_SHOWN} more" if len(names) > FILES_SHOWN else ""
            out.append(f"{len(names)} file(s) {what} ({shown}{more})")
    return out
