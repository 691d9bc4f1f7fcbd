"""One owner per run folder: `flock` on the folder itself, held for the whole job.

Taking it writes nothing (a start that then fails leaves an existing folder byte-identical), and the kernel drops it
when its holder dies (no stale lock after a SIGKILL). The holder writes who it is to `<run>/.lock`, which a second
start names in its one-line error. Under `ddplab train --nproc-per-node` the launcher holds it (so `--max-restarts`
keeps it) and tells its workers (runtime/handoff.py: locked_run) with a token its holder file holds too; a worker
believes it only when that holder is a process above it. Under plain torchrun or srun, rank 0 holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path

from ddplab.engine.run_folder.files import read_json, write_atomic
from ddplab.engine.run_folder.folder import RunFiles
from ddplab.errors import UserError
from ddplab.runtime.handoff import Handoff

HOLDER_FILE = ".lock"
LOCKED_ENV = Handoff.variable("locked_run")  # what a refusal names


def resolve_run_dir(cfg) -> tuple[Path, str | None]:
    """experiments/<name>; a folder holding a finished run is kept, and the new run gets <name>-2, -3, ..."""
    base = Path(cfg.experiment.output_dir) / cfg.run_name()
    if not base.exists() or (cfg.checkpoint.resume != "never" and not RunFiles(base).finished()):
        return base, None
    i = 2
    while Path(f"{base}-{i}").exists() and (RunFiles(f"{base}-{i}").finished() or cfg.checkpoint.resume == "never"):
        i += 1
    return Path(f"{base}-{i}"), f"{base} holds a finished run; this run writes {base}-{i}"


class RunLock:
    """`flock(LOCK_EX | LOCK_NB)` on a folder; `UserError` naming the holder when taken."""

    def __init__(
        self, path: str | Path, what: str = "run folder", names: str = "experiment.output_dir and experiment.name"
    ) -> None:
        self.path = Path(path)
        self.what = what
        self.names = names  # the settings that chose the folder, for the error messages
        self.fd: int | None = None
        self.token = secrets.token_hex(16)  # in the holder file: what a worker of this holder is told
        self._created: list[Path] = []  # the folders this start made itself, outermost first

    def acquire(self) -> RunLock:
        """Create the folder if needed (a new folder only) and lock it; raise if another job holds it.

        Starts may race: another start may lock the folder first, or remove a folder it made itself
        (a start that failed). A folder is removed only by the one that holds its lock, and the lock
        counts only if the path still names the folder locked; else this start begins again."""
        while True:
            created = self._make()
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:  # removed by the start that made it, between the two calls
                if os.path.lexists(self.path):  # a link to nowhere, which mkdir took for a folder
                    raise self._cannot(self.path, "a symbolic link to nowhere") from None
                continue
            except OSError as err:  # a file where the folder should be
                raise self._cannot(self.path, err.strerror) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise UserError(
                    f"{self.what} {self.path} is in use by {holder(self.path)}; wait for it to end, "
                    f"or change {self.names}"
                ) from None
            with contextlib.suppress(OSError):  # the lock counts if the path still names the folder locked
                if os.path.samestat(os.stat(self.path), os.fstat(fd)):
                    break
            os.close(fd)
        self.fd, self._created = fd, created
        write_atomic(  # removed at release, so a start that fails leaves the folder as it found it
            self.path,
            HOLDER_FILE,
            json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "token": self.token}) + "\n",
        )
        return self

    def _make(self) -> list[Path]:
        """The folder and its missing parents; the ones this call made (another start may make some).
        A parent removed meanwhile by a start that failed: begin again."""
        while True:
            made: list[Path] = []
            for p in reversed([self.path, *self.path.parents]):
                try:
                    p.mkdir()
                    made.append(p)
                except FileExistsError:
                    continue
                except FileNotFoundError:
                    if not os.path.lexists(p.parent):
                        break  # removed meanwhile: begin again
                    # a link to nowhere (mkdir takes it for a folder), or a place that takes no folders (/proc)
                    why = "a symbolic link to nowhere" if p.parent.is_symlink() else "a folder that takes no new ones"
                    raise self._cannot(p.parent, why) from None
                except OSError as err:  # a file where a folder should be, a read-only place, ...
                    raise self._cannot(self.path, err.strerror) from None
            else:
                return made

    def _cannot(self, where: Path, why: str | None) -> UserError:
        shown = "" if where == self.path else f"{where} is "
        return UserError(f"cannot create {self.what} {self.path}: {shown}{why} (check {self.names})")

    def worker_env(self) -> dict:
        """What tells the workers this process starts that it holds their run folder."""
        return Handoff(locked_run=str(self.path), lock_token=self.token).env()

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(HOLDER_FILE, dir_fd=self.fd)
        # Still locked: a start that left nothing behind removes the folders it made, before anyone else
        # can take the lock (whoever then locks the removed folder sees it gone, and begins again).
        for p in reversed(self._created):
            try:
                p.rmdir()
            except OSError:
                break
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> RunLock:
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
    info = read_json(Path(path) / HOLDER_FILE)
    if "host" in info and "pid" in info:
        return f"another ddplab job (host {info['host']}, PID {info['pid']})"
    return "another ddplab job that is still starting"


def _ancestors() -> set[int]:
    """The PIDs above this process (Linux's /proc; elsewhere only the parent)."""
    found, pid = set(), os.getppid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found


def launcher_lock() -> Path | None:
    """The run folder the ddplab launcher that started this process holds; None when none does.
    The variables are believed only when the folder's lock is held, its holder file carries their
    token, and its holder is a process above this one."""
    told = Handoff.read()
    named = told.locked_run
    if not named:
        return None
    info = read_json(Path(named) / HOLDER_FILE)
    token, told_token = str(info.get("token")).encode(), (told.lock_token or "").encode()
    ours = told_token and secrets.compare_digest(token, told_token) and info.get("pid") in _ancestors()
    if not (ours and held(Path(named))):
        raise UserError(
            f"{LOCKED_ENV}={named} is set, but no ddplab launcher above this process holds that run "
            f"folder; unset {LOCKED_ENV} (ddplab's launcher sets it for its own workers)"
        )
    return Path(named)


def claim(
    cfg, resolved: tuple[Path, str | None], check_resume: Callable, launcher: Path | None = None
) -> tuple[RunLock | None, tuple]:
    """Rank 0: lock the resolved run folder (unless `launcher`, the folder this process's launcher holds,
    is that folder) and check that an unfinished run there may be continued under `cfg` (`check_resume`:
    snapshots/fingerprint.py's, handed down so that the run folder imports no room above it). Returns the lock
    and, for every rank, (run_dir, note, error message or None)."""
    run_dir, note = resolved
    lock = None
    try:
        if not (launcher and launcher.resolve() == Path(run_dir).resolve()):
            lock = RunLock(run_dir).acquire()
        if cfg.checkpoint.resume == "auto":
            check_resume(run_dir, cfg.to_dict())
    except UserError as err:
        if lock is not None:
            lock.release()
        return None, (run_dir, note, str(err))
    return lock, (run_dir, note, None)


@contextlib.contextmanager
def own_run_folder(cfg, ctx, check_resume: Callable):
    """Every rank: yields (run_dir, note) once rank 0 owns the folder resolve_run_dir(cfg) picks;
    raises the same UserError on every rank when it cannot. Released when the job ends."""
    lock, decision = None, None
    if ctx.is_main:
        try:
            launcher = launcher_lock()  # the launcher picked (and holds) the folder
        except UserError as err:
            decision = (None, None, str(err))
        else:
            lock, decision = claim(cfg, (launcher, None) if launcher else resolve_run_dir(cfg), check_resume, launcher)
    try:
        run_dir, note, error = ctx.broadcast_object(decision)
        if error:
            raise UserError(error)
        yield run_dir, note
    finally:
        if lock is not None:
            lock.release()
