"""What every ddplab command may exit with, and the exceptions that tell failures apart: a `UserError`
is bad input found before any process starts (one line on stderr, exit 2); a `RunError` is a failure at
run time whose cause is known (one line on stderr, exit 1, the run recorded as failed); anything else is
a bug and keeps its traceback (exit 1)."""

from __future__ import annotations

import enum


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
    """A failure at run time with a known cause (a non-finite loss, a disk that is full, a snapshot that
    cannot be written): one line, exit 1, `status: failed` in metrics.json."""

    exit_code = ExitCode.FAILED


class Preempted(Exception):
    """A job stopped by a signal, its snapshot saved: exit 75, and the same command continues it."""

    exit_code = ExitCode.PREEMPTED


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line of text ("" if it has none), for a one-line UserError about it."""
    return (str(exc).strip().splitlines() or [""])[0][:limit]
