"""Exit codes, and the exceptions that tell failures apart: `UserError` (bad input, exit 2), `RunError` (a
known failure at run time, exit 1, recorded); anything else is a bug and keeps its traceback (exit 1)."""

from __future__ import annotations

import enum
import errno
import shutil
from pathlib import Path


class ExitCode(enum.IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2  # bad input: one line on stderr, before any process group starts
    PREEMPTED = 75  # sysexits.h EX_TEMPFAIL ("the user is invited to retry"): a requeue script reruns the command
    INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


class UserError(Exception):
    """Bad input: an unknown key, a wrong type, a missing file, an unknown name."""

    exit_code = ExitCode.USAGE


class RunError(Exception):
    """A failure at run time with a known cause: one line, exit 1, `status: failed` in metrics.json."""

    exit_code = ExitCode.FAILED


class LighthouseLost(RunError):
    """The replica groups' torchft Lighthouse cannot be reached: a failure the report blames no process for."""


class Preempted(Exception):
    """A job stopped by a signal, its snapshot saved: exit 75, and the same command continues it."""

    exit_code = ExitCode.PREEMPTED


class Interrupted(Preempted):
    """A job stopped by Ctrl-C, its snapshot saved: exit 130, and the same command continues it."""

    exit_code = ExitCode.INTERRUPTED


# A run's status in metrics.json -> the exit code of the command that ended it, and of `ddplab status` on it.
STATUS_CODES = {"complete": ExitCode.OK, "preempted": ExitCode.PREEMPTED, "interrupted": ExitCode.INTERRUPTED}


def stopped(kind: str, what: str) -> Preempted:
    """The exception for a job that a signal stopped, "{stop}" in `what` read "interrupted" or "pre-empted"."""
    if kind == "interrupted":
        return Interrupted(what.replace("{stop}", "interrupted"))
    return Preempted(what.replace("{stop}", "pre-empted"))


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line of text ("" if it has none), for a one-line UserError about it."""
    return (str(exc).strip().splitlines() or [""])[0][:limit]


def printable(text: str, keep: str = "") -> str:
    """Text from users as a terminal shows it harmlessly: each character it would act on (a newline, an ANSI
    escape) written as its Python escape, but those in `keep`."""
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


_FULL = (errno.ENOSPC, errno.EDQUOT)  # the disk, or the user's quota, is full
# Less than this free, a write that failed for a reason its library did not name (torch.save's zip writer
# says "unexpected pos") failed for want of space too.
_NEARLY_FULL = 1 << 20


def disk_full(exc: BaseException | None) -> OSError | None:
    """The OSError saying "no space left" in an exception or the chain of causes behind it, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def free_space(path: str | Path) -> int | None:
    """Bytes free on the disk that holds `path` (or the nearest folder above it that exists)."""
    for place in (Path(path), *Path(path).parents):
        try:
            return shutil.disk_usage(place).free
        except OSError:
            continue
    return None


def no_space(exc: BaseException, path: str | Path) -> bool:
    """`exc` says the disk is full, or was raised while the disk that holds `path` is (nearly) full."""
    free = free_space(path)
    return disk_full(exc) is not None or (free is not None and free < _NEARLY_FULL)


def write_failed(path: str | Path, exc: BaseException) -> RunError:
    """The one line for a file ddplab could not write. Raise it `from exc`: the traceback stays in logs/."""
    if no_space(exc, path):
        return RunError(f"no space left on device writing {path} ({size_text(free_space(path))} free)")
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {first_line(exc)}"
    return RunError(f"cannot write {path}: {reason}")


def size_text(n: int | None) -> str:
    """Bytes as people read them: 512 B, 4.0 KiB, 1.5 GiB."""
    if n is None:
        return "unknown space"
    size, units = float(n), ["B", "KiB", "MiB", "GiB", "TiB"]
    while size >= 1024 and len(units) > 1:
        size, units = size / 1024, units[1:]
    return f"{n} B" if units[0] == "B" else f"{size:.1f} {units[0]}"
