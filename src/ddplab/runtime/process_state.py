"""Every change ddplab makes to the process as a whole (TF32, the collector, glibc's malloc, environment
variables, sys.path, signal handlers, logger levels): made here, recorded, shown (`in_effect`, the run's first
log line) and undone, last first, when a `changes()` block ends: `ddplab.train()` in a user's own process
leaves it as it found it. An environment variable is only ever set as a default (`env_default`)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator

_undo: list[tuple[str, Callable[[], object]]] = []  # (what was changed, how to put it back), oldest first


def _record(what: str, undo: Callable[[], object]) -> None:
    _undo.append((what, undo))


def in_effect() -> list[str]:
    """The changes in force now, oldest first, in words."""
    return [what for what, _ in _undo]


@contextlib.contextmanager
def changes() -> Iterator[None]:
    """Undo, last first, every change made inside the block, however it ends."""
    depth = len(_undo)
    try:
        yield
    finally:
        while len(_undo) > depth:
            _, undo = _undo.pop()
            undo()


def env_default(names: str | tuple[str, ...], value: str) -> bool:
    """Set every one of `names` (a variable's current and older spellings) to `value`, unless the user
    set any of them. Returns whether ddplab set them."""
    names = (names,) if isinstance(names, str) else names
    if any(n in os.environ for n in names):
        return False
    os.environ.update(dict.fromkeys(names, value))
    _record(f"{'='.join(names)}={value}", lambda: [os.environ.pop(n, None) for n in names])
    return True


def env_unset(name: str, why: str) -> None:
    """Remove an environment variable this process inherited (`why`: what keeping it would do)."""
    if (before := os.environ.pop(name, None)) is not None:
        _record(f"{name} unset ({why})", lambda: os.environ.__setitem__(name, before))


def import_path(folder: str) -> None:
    """Put `folder` first on sys.path (a workload file imports its neighbours, as under `python file.py`)."""
    if folder in sys.path:
        return
    sys.path.insert(0, folder)

    def undo() -> None:
        if folder in sys.path:
            sys.path.remove(folder)

    _record(f"sys.path + {folder}", undo)


def logger_level(name: str, level: int) -> None:
    """Quieten a library's logger (one that chatters at INFO on every start)."""
    logger = logging.getLogger(name)
    before = logger.level
    if before == level:
        return
    logger.setLevel(level)
    _record(f"logger {name} at {logging.getLevelName(level)}", lambda: logger.setLevel(before))


def signal_handler(signum: int, handler) -> bool:
    """Handle `signum` with `handler`, from the main thread only (Python's rule). Returns whether it could."""
    try:
        before = signal.signal(signum, handler)
    except ValueError:  # not the main thread
        return False
    _record(f"{signal.Signals(signum).name} handled by ddplab", lambda: signal.signal(signum, before))
    return True


def tf32(on: bool) -> None:
    """TF32 for float32 matmuls and cuDNN convolutions on, or both off (torch's default: off for matmuls, on for
    convolutions); only a GPU reads either flag, so a process without CUDA is left alone."""
    import torch  # only a run on a GPU gets here with a reason to load it

    if not torch.cuda.is_available():
        return
    matmul, conv = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    wanted, said = ("high", "on") if on else ("highest", "off")
    if matmul != wanted:
        torch.set_float32_matmul_precision(wanted)
        _record(f"TF32 matmuls {said} (training.tf32)", lambda: torch.set_float32_matmul_precision(matmul))
    if conv != on:
        torch.backends.cudnn.allow_tf32 = on
        _record(f"TF32 convolutions {said} (training.tf32)", lambda: setattr(torch.backends.cudnn, "allow_tf32", conv))


def freeze_gc() -> None:
    """Leave every object alive now out of garbage collection until the undo: the ~350,000 objects alive at a
    run's start are never traversed, and a full collection takes microseconds instead of 0.2 s. A process that
    froze objects itself keeps its own frozen generation: unfreezing could not tell its objects from ours."""
    if gc.get_freeze_count():
        return
    gc.freeze()
    _record(f"gc: {gc.get_freeze_count()} objects frozen", gc.unfreeze)


# glibc's mallopt() parameters (malloc.h) and their documented defaults.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, GLIBC_DEFAULT = -1, -3, 128 * 1024
KEEP = 1 << 30  # bytes: blocks up to this come from the heap, and up to this much free heap is kept
CAPPED = 32 << 20  # mallopt(3)'s documented cap on 64-bit hosts; the glibc tested here (2.36) takes more


def keep_freed_memory() -> int:
    """Have glibc keep the memory a training step frees, for the next step to reuse, instead of paying for the
    same buffers in page faults every step: on a 2-core CPU, page faults 534 K -> 204 K and epoch time -4 % for
    the 2-layer char GPT, 1.19 M -> 237 K and -7 % for the text Transformer (benchmarks/host_memory.py).

    Returns the size below which blocks now come from the heap: 1 GiB, or 32 MiB on a glibc that caps it; 0
    where there is no glibc to ask. glibc's sliding mmap threshold, off once set, stays off after the undo."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return 0
    mallopt.argtypes, mallopt.restype, trim.argtypes = [ctypes.c_int, ctypes.c_int], ctypes.c_int, [ctypes.c_size_t]
    if not mallopt(M_TRIM_THRESHOLD, KEEP):
        return 0

    def undo() -> None:
        mallopt(M_TRIM_THRESHOLD, GLIBC_DEFAULT)
        mallopt(M_MMAP_THRESHOLD, GLIBC_DEFAULT)
        trim(0)

    kept = next((t for t in (KEEP, CAPPED) if mallopt(M_MMAP_THRESHOLD, t)), 0)
    _record(f"glibc keeps freed memory below {kept >> 20} MiB (training.keep_host_memory)", undo)
    return kept


# What ends a job from outside (SLURM's pre-emption, `scancel`, torchrun's agent, Ctrl-C): a rank acts on them
# (engine/loop/preemption.py), holds them while it writes a failure report (heartbeat.py), and its loader
# workers leave them to it (loaders.py).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux); exit now if it is gone."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent or parent == 1:
        os._exit(128 + int(sig))
