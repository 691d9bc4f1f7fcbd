"""Writing into a folder that others may have touched: never through a symbolic link, never by accident over a file.

A run folder may come from elsewhere (downloaded, pre-empted, shared): a link planted where
ddplab writes a file must not turn that write into a write somewhere else. So every file ddplab
writes in a run folder goes through `write_atomic` or `open_append`, which walk from the folder
down to the file without following a link, and refuse a link where a file or a subfolder belongs.
`write_atomic` writes the whole content under a temporary name no other writer uses (created
exclusively, so no file or link already there is ever opened) and renames it over the target: a
reader sees the old content or the new, never half of it. The folder itself is the caller's choice
(an `experiments` link to a larger disk is fine); only what lies inside it is checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from ddplab.errors import RunError

NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _parts(name: str | Path) -> list[str]:
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or any(p in ("..", ".") for p in parts):
        raise ValueError(f"{name!r} is not a path inside a folder")
    return list(parts)


def _refuse(fd: int, name: str, shown: Path, want_dir: bool) -> bool:
    """Whether `name` exists in the folder `fd`; RunError for a link, or the wrong kind of entry."""
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(mode):
        raise RunError(
            f"refusing to write {shown}: it is a symbolic link (to {os.readlink(name, dir_fd=fd)}); remove it"
        )
    if want_dir and not stat.S_ISDIR(mode):
        raise RunError(f"refusing to write into {shown}: it is not a folder")
    if not want_dir and not stat.S_ISREG(mode):
        raise RunError(f"refusing to write {shown}: it is not a regular file")
    return True


def _open_folder(folder: Path, parents: list[str]) -> int:
    """A descriptor of folder/parents..., each subfolder made if missing and none of them a link."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = Path(folder)
    try:
        for part in parents:
            shown = shown / part
            if not _refuse(fd, part, shown, want_dir=True):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            sub = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_atomic(folder: str | Path, name: str | Path, content: str | bytes | Callable, sync: bool = False) -> Path:
    """`folder/name` holds `content` whole (str, bytes, or a function that writes into a binary file),
    or after a crash its previous content. No link is followed below `folder`; with `sync`, the data
    and the rename are on disk when this returns. Returns the file's path."""
    *parents, leaf = _parts(name)
    path = Path(folder, name)
    fd = _open_folder(Path(folder), parents)
    try:
        _refuse(fd, leaf, path, want_dir=False)
        tmp = f".{leaf}.{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}.tmp"
        out = os.open(tmp, NEW_FILE, 0o666, dir_fd=fd)
        try:
            with os.fdopen(out, "wb") as f:
                if callable(content):
                    content(f)
                else:
                    f.write(content.encode() if isinstance(content, str) else content)
                if sync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, leaf, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return path


def open_append(folder: str | Path, name: str | Path):
    """`folder/name` opened for appending text (line-buffered), made if missing; never through a link."""
    *parents, leaf = _parts(name)
    fd = _open_folder(Path(folder), parents)
    try:
        _refuse(fd, leaf, Path(folder, name), want_dir=False)
        out = os.open(leaf, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=fd)
    finally:
        os.close(fd)
    return os.fdopen(out, "a", buffering=1)


def read_json(path: str | Path) -> dict:
    """A JSON file's content; {} when it is missing or unreadable (not yet written, or written by another version)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def subfolder(folder: str | Path, name: str | Path) -> Path:
    """folder/name as a real folder (made if missing), for writers that take a folder (TensorBoard)."""
    os.close(_open_folder(Path(folder), _parts(name)))
    return Path(folder, name)
