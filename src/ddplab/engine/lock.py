"""One owner per run folder: an OS lock held for the whole job.

The lock is `flock` on the run folder itself (a directory file descriptor), so taking it
writes nothing: a start that then fails leaves an existing folder byte-identical. The
kernel drops it when its holder dies, so a SIGKILL never leaves a stale lock. The holder
writes who it is (host, PID) to `<run>/.lock` and removes it at release; a second start
finds the folder locked and names that holder in its one-line error.

Under `ddplab train --nproc-per-node` the launcher holds the lock (so `--max-restarts`
restarts keep it) and tells the workers through DDPLAB_LOCKED_RUN; under plain torchrun
or srun, rank 0 holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from pathlib import Path

from ddplab.errors import UserError
from ddplab.engine.run_folder import RunFolder

HOLDER_FILE = ".lock"
LOCKED_ENV = "DDPLAB_LOCKED_RUN"  # the run folder a ddplab launcher already holds


def finished(run_dir: Path) -> bool:
    """A run that ended by itself; a crashed ("running") or pre-empted one is continued instead."""
    try:
        return json.loads((run_dir / RunFolder.METRICS_JSON).read_text()).get("status") == "complete"
    except (OSError, ValueError):
        return False


def resolve_run_dir(cfg) -> tuple[Path, str | None]:
    """experiments/<name>; a folder holding a finished run is kept, and the new run gets <name>-2, -3, ..."""
    base = Path(cfg.experiment.output_dir) / cfg.run_name()
    if not base.exists() or (cfg.checkpoint.resume != "never" and not finished(base)):
        return base, None
    i = 2
    while Path(f"{base}-{i}").exists() and (finished(Path(f"{base}-{i}")) or cfg.checkpoint.resume == "never"):
        i += 1
    return Path(f"{base}-{i}"), f"{base} holds a finished run; this run writes {base}-{i}"


class RunLock:
    """`flock(LOCK_EX | LOCK_NB)` on a folder; `UserError` naming the holder when taken."""

    def __init__(self, path: str | Path, what: str = "run folder",
                 names: str = "experiment.output_dir and experiment.name") -> None:
        self.path = Path(path)
        self.what = what
        self.names = names  # the settings that chose the folder, for the error messages
        self.fd: int | None = None
        self._created: Path | None = None  # the outermost folder this lock created (removed if left empty)

    def acquire(self) -> "RunLock":
        """Create the folder if needed (a new folder only) and lock it; raise if another job holds it."""
        missing = [p for p in (self.path, *self.path.parents) if not p.exists()]
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # a file where a folder should be, a read-only place, ...
            raise UserError(f"cannot create {self.what} {self.path}: {err.strerror} (check {self.names})") from None
        self._created = missing[-1] if missing else None
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._remove_if_empty()
            raise UserError(f"{self.what} {self.path} is in use by {holder(self.path)}; wait for it to end, "
                            f"or change {self.names}") from None
        self.fd = fd
        # Who holds it, for the error of a second start; removed again at release, so a
        # start that fails leaves the folder as it found it.
        tmp = self.path / f"{HOLDER_FILE}.tmp"
        tmp.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}) + "\n")
        os.replace(tmp, self.path / HOLDER_FILE)
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        (self.path / HOLDER_FILE).unlink(missing_ok=True)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
        self._remove_if_empty()

    def _remove_if_empty(self) -> None:
        """A start that failed leaves no empty folder behind (only the ones it created)."""
        if self._created is None:
            return
        for p in (self.path, *self.path.parents):
            try:
                p.rmdir()
            except OSError:
                return
            if p == self._created:
                return

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def held(path: Path) -> bool:
    """Some live process holds the run folder's lock (the kernel dropped it if its holder died)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def holder(path: Path) -> str:
    """'host H, PID P' from the holder's file, or a vaguer phrase while it is still starting."""
    try:
        info = json.loads((Path(path) / HOLDER_FILE).read_text())
        return f"another ddplab job (host {info['host']}, PID {info['pid']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another ddplab job that is still starting"


def claim(cfg, resolved: tuple[Path, str | None]) -> tuple[RunLock | None, tuple]:
    """Rank 0: lock the resolved run folder (unless the launcher holds it) and check that an
    unfinished run there may be continued under `cfg`. Returns the lock and, for every rank,
    (run_dir, note, error message or None)."""
    from ddplab.engine.fingerprint import check_resume  # keeps the launcher's import of lock.py light

    run_dir, note = resolved
    held = os.environ.get(LOCKED_ENV)  # the run folder the ddplab launcher that started this worker holds
    lock = None
    try:
        if not (held and Path(held).resolve() == Path(run_dir).resolve()):
            lock = RunLock(run_dir).acquire()
        if cfg.checkpoint.resume == "auto":
            check_resume(run_dir, cfg.to_dict())
    except UserError as err:
        if lock is not None:
            lock.release()
        return None, (run_dir, note, str(err))
    return lock, (run_dir, note, None)


@contextlib.contextmanager
def own_run_folder(cfg, ctx, resolve):
    """Every rank: yields (run_dir, note) once rank 0 owns the folder `resolve(cfg)` picks;
    raises the same UserError on every rank when it cannot. Released when the job ends."""
    if ctx.is_main:
        launcher_held = os.environ.get(LOCKED_ENV)  # the launcher picked (and holds) the folder
        lock, decision = claim(cfg, (Path(launcher_held), None) if launcher_held else resolve(cfg))
    else:
        lock, decision = None, None
    try:
        run_dir, note, error = ctx.broadcast_object(decision)
        if error:
            raise UserError(error)
        yield run_dir, note
    finally:
        if lock is not None:
            lock.release()
