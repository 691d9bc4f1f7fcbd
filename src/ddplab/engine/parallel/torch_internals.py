"""Every private name of torch's, and every part of the interpreter's internals, that ddplab uses: here and
nowhere else, each with why no public API does the job. A private name can move in any torch release;
tests/test_torch_internals.py checks each one used here (that it exists, its parameters, what it does) and
names the function to mend when one moved.

Checked on torch 2.14.1 (CPU) and 2.11 (CUDA). torch is imported inside each function: the launcher imports
this module and never torch (commands/launch.py: the agent does, as torchrun).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.machinery
import importlib.util
import io
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

    # FSDP's comm interfaces, for the checker only (engine/parallel/fsdp_comm.py)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as AllGather
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as ReduceScatter

CHECKED_ON = ("2.11", "2.14.1")


# ------------------------------------------------------------------ autograd and DDP (engine/parallel/ddp_comm.py)
def queue_after_backward(callback: Callable[[], None]) -> None:
    """Run `callback` when the backward pass in progress has ended, after the callbacks queued before it (DDP's
    and FSDP's own, which wait for their reductions). Only autograd's engine knows when a whole pass ends; DDP
    itself uses this private call. Call it from inside the backward pass (a tensor hook)."""
    import torch  # here, not at the top: the launcher imports this module, never torch

    torch.autograd.Variable._execution_engine.queue_callback(callback)


def ddp_buckets(params: list[torch.Tensor], bucket_cap_mb: float) -> list[list[int]]:
    """The gradient buckets DDP would make of `params` (indices into it), its first bucket capped at DDP's
    first-bucket size: DDP's own assignment, which no public API exposes without a process group and a model
    wrapped in DDP (the layout reported for a 1-process run)."""
    import torch.distributed as dist  # here: the launcher never imports torch

    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, int(bucket_cap_mb * 2**20)]
    groups, _ = dist._compute_bucket_assignment_by_size(params, limits)
    return [list(group) for group in groups]


def default_store():
    """The process group's own key-value store (torchrun's TCPStore), which the heartbeat shares with it: a
    store of its own would need a port more on every node, and torch offers the default one privately only."""
    import torch.distributed as dist  # here: the launcher never imports torch

    return dist.distributed_c10d._get_default_store()


# ------------------------------------------------------------------ FSDP (engine/parallel/fsdp_comm.py)
class FsdpComms(NamedTuple):
    """One FSDP module's parameter group's collectives, as FSDP set them (a shard function may have)."""

    all_gather: Any
    reduce_scatter: Any
    hsdp: bool  # replicated across nodes too: an all-reduce after the reduce-scatter
    all_reduce_hook: Any  # the user's, or None


def fsdp_comms(module) -> list[FsdpComms]:
    """The collectives of each parameter group of an FSDP module (fully_shard): the public setters
    (set_custom_all_gather, set_custom_reduce_scatter) replace them, and only the private state holds the ones
    in use, which ddplab wraps to time them instead of replacing a user's."""
    return [
        FsdpComms(g._all_gather_comm, g._reduce_scatter_comm, g._is_hsdp, g._all_reduce_hook)
        for g in module._get_fsdp_state()._fsdp_param_groups
    ]


# ------------------------------------------------- torch.compile (engine/loop/setup.py, sharding.py, phases.py)
def import_dynamo() -> None:
    """Import torch.compile's machinery (what every worker imports once its first optimizer is built), in the
    agent before it forks the workers, so that they pay for it once (3.5 s of CPU each, launch.py)."""
    import torch._dynamo  # noqa: F401 - here: only the agent, which forks workers, imports it


def mark_batch_dynamic(tensor: torch.Tensor) -> None:
    """Tell torch.compile that the first dimension (the batch) varies, so that a last, smaller batch does not
    recompile the model: torch.compiler has no public counterpart of maybe_mark_dynamic."""
    import torch._dynamo  # here: a second to import, for compiled runs only

    torch._dynamo.maybe_mark_dynamic(tensor, 0)


def uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module a torch.compile'd module wraps (itself if not compiled): its parameters keep their own names
    (no `_orig_mod.` prefix) and DDP's and FSDP's methods are reached on it. torch.compile offers no public
    way back; dynamo is looked for only when something has imported it (a second to import for nothing)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule):
        return model._orig_mod
    return model


def compile_callbacks():
    """Dynamo's handler of compile start / end callbacks (register_start_callback, register_end_callback and
    their remove_ counterparts): how long torch.compile spent compiling, which no public API reports."""
    from torch._dynamo.callback import callback_handler  # here: only a compiled run pays for dynamo's import

    return callback_handler


# ------------------------------------------------------------------ DataLoader (engine/loop/loaders.py)
def stop_loader_workers(loader) -> None:
    """Stop a DataLoader's persistent workers (and its pin-memory thread) now. torch stops them only when the
    loader itself is collected, or at the interpreter's exit; the iterator that holds them lives in a private
    attribute, and shutting it down is the private method torch itself calls then."""
    iterator, loader._iterator = loader._iterator, None
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):  # a single-process iterator has none
        iterator._shutdown_workers()


def loader_shutting_down() -> Callable[[], bool] | None:
    """In a DataLoader worker (from its worker_init_fn): whether its loader is shutting its workers down, read from
    the event torch's worker loop is handed (`_worker_loop`'s `done_event`), which no public API hands a worker's
    code; None where torch moved it. The check takes the event's lock: a signal handler runs it in another thread,
    or it could wait for a lock its own thread holds."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_worker_loop":
        frame = frame.f_back
    done = frame.f_locals.get("done_event") if frame is not None else None
    return None if done is None else done.is_set


# ------------------------------------------------------------------ the interpreter (commands/launch.py)
def fork_torchrun_workers(change: Callable[[Any, Any, list[str]], tuple[Any, Any, list[str]]]) -> None:
    """Let `change` rewrite torchrun's launch config, command and arguments as it reads its command line
    (`change(config, cmd, cmd_args)` returns the three): the one place where torchrun can be told to start a
    worker by forking a function (config.start_method = "fork", cmd = a callable), which its public API takes
    but its command line does not."""
    import torch.distributed.run as torchrun  # here: the agent only (the launcher never imports torch)

    plain = torchrun.config_from_args

    def config_from_args(args):
        return change(*plain(args))

    torchrun.config_from_args = config_from_args


def continue_workers_it_ends() -> None:
    """Make torchrun's agent send SIGCONT to each worker it ends, as a shell does for a stopped job it kills.
    A worker stopped (SIGSTOP, Ctrl-Z) acts on no signal but SIGKILL, and the agent, ending the workers after
    one failed, sends SIGTERM and waits 30 s before SIGKILL: a stopped rank held the whole job that long.
    Continued, it acts on SIGTERM (and on its heartbeat's news of the failure) at once. No public hook runs
    when the agent ends its workers: forked ones are ended by torch.multiprocessing's ProcessContext.join
    (multiprocessing's Process.terminate, then 30 s, which --shutdown-timeout does not reach), exec'd ones
    and any stop signal by PContext.close; both are wrapped here."""
    import multiprocessing.process  # here: the agent only
    import os
    import signal

    from torch.distributed.elastic.multiprocessing.api import PContext  # here: the launcher never imports torch

    def resume(pid: int | None) -> None:
        if pid is not None:  # a process not yet started has none
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    terminate, close = multiprocessing.process.BaseProcess.terminate, PContext.close

    def terminate_continued(self) -> None:
        terminate(self)
        resume(self.pid)

    def close_continued(self, death_sig=None, timeout=30):
        with contextlib.suppress(Exception):  # none started, or gone already
            for pid in self.pids().values():
                resume(pid)
        return close(self, death_sig, timeout)

    multiprocessing.process.BaseProcess.terminate = terminate_continued  # type: ignore[method-assign]
    PContext.close = close_continued  # type: ignore[method-assign]


def name_rendezvous_events_cheaply() -> None:
    """Have torchrun's rendezvous name its events from the calling frame instead of `inspect.stack()`. It names
    each event (at every state change, whether or not any handler records events: none does by default) with two
    calls of `inspect.stack()`, which reads the source of every frame on the stack and scans `sys.modules` for
    each: once torch._dynamo is imported (as the agent does, import_dynamo), 0.4 s of the agent's CPU per
    rendezvous on this project's test machine, a fifth of a small 2-process job. The name is the same."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous  # here: the agent only

    def get_method_name(depth: int = 2) -> str:
        frame: FrameType | None = sys._getframe(0)
        for _ in range(depth):
            frame = frame.f_back if frame is not None else None
        return frame.f_code.co_name if frame is not None else "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


def thread_frame(ident: int):
    """The frame another thread is running now (None once it has ended): where a stalled rank's training thread
    stands, for its report. sys._current_frames is the one way to read it (faulthandler only prints it)."""
    return sys._current_frames().get(ident)


def run_exit_handlers() -> None:
    """Run the functions registered with atexit now (each once), as the interpreter would at its exit: before
    os._exit, which skips them, in a process that ends without the interpreter's teardown."""
    atexit._run_exitfuncs()


def drop_exit_handlers() -> None:
    """Forget the atexit functions a forked worker inherited from its parent (torchrun's agent): they are the
    agent's to run, not the worker's. atexit offers unregister(func) only, for functions one knows."""
    atexit._clear()


def unbuffered_std_streams() -> None:
    """sys.stdout and sys.stderr written through at once, as `python -u` makes them: a forked worker inherits its
    agent's buffered ones, and the flag can only be given to a new interpreter."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        raw = io.FileIO(stream.fileno(), "w", closefd=False)
        setattr(sys, name, io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors, write_through=True))


def as_python_m(main: Path, args: list[str]) -> None:
    """sys.argv as `python -m PACKAGE ARGS` sets it (its __main__.py, then ARGS), for code that reads it in a
    worker forked from a process started with other arguments."""
    sys.argv = [str(main), *args]


# ------------------------------------------------------------------ torchft (commands/launch.py: lighthouse)
def torchft_lighthouse(**options):
    """torchft's Lighthouse server (LighthouseServer(**options), running in threads of its own), without
    importing the torchft package, whose __init__ imports torch: 4-5 s of CPU, at each replica job's start, for a
    server written in Rust, and the launcher imports no torch. The server is in the package's compiled module
    (torchft/_torchft*.so), loaded here by itself. Checked on torchft 0.2.0."""
    package = importlib.util.find_spec("torchft")  # found, not imported
    assert package is not None and package.submodule_search_locations, "torchft is not installed"
    (path,) = Path(package.submodule_search_locations[0]).glob("_torchft.*.so")
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(path))
    module = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(loader.name, loader, origin=str(path)))
    loader.exec_module(module)
    return module.LighthouseServer(**options)
