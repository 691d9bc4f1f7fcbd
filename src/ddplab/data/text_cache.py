"""Building a cache once a node while the other ranks wait (`ensure`), atomically (`building`)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from ddplab.errors import UserError

META = "meta.json"


def is_complete(folder: Path) -> bool:
    return (folder / META).is_file()


def cache_root(cfg) -> Path:
    """Where caches live: data.cache_dir, else <output_dir>/.cache."""
    return Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.experiment.output_dir) / ".cache"


@contextlib.contextmanager
def building(folder: Path) -> Iterator[Path]:
    """A temporary folder that becomes `folder` once written, so a half-written cache is never read."""
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


def ensure(ctx, folder: Path | None, build: Callable[[], None], what: str = "cache") -> None:
    """Rank 0 builds a missing cache folder while the others wait; errors reach every rank. Without a filesystem
    shared across nodes, each node's first rank builds its own. folder=None (tokenised text): every rank runs
    `build`, one rank a node first, the others after it (reusing what it cached)."""
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
