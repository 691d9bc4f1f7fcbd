"""Each private name of torch's and each interpreter internal ddplab uses (engine/parallel/torch_internals.py) still is
what ddplab takes it for: a test fails naming the name that moved and the function of torch_internals to mend."""

from __future__ import annotations

import importlib
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import _env
from ddplab.engine.parallel import torch_internals as internals


def moved(name: str, fn, what: str = "is gone") -> str:
    return (
        f"torch {torch.__version__}: {name} {what}; mend ddplab.engine.parallel.torch_internals.{fn.__name__} "
        f"(checked on torch {', '.join(internals.CHECKED_ON)})"
    )


def resolve(dotted: str, fn):
    """The object a dotted name names (a module, then attributes), or a failure that says which moved."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            assert hasattr(found, attr), moved(dotted, fn)
            found = getattr(found, attr)
        return found
    pytest.fail(moved(dotted, fn))


def takes(dotted: str, fn, *params: str) -> None:
    """`dotted` is a function whose parameters begin with `params`."""
    found = resolve(dotted, fn)
    names = list(inspect.signature(found).parameters)
    assert names[: len(params)] == list(params), moved(
        dotted, fn, f"takes ({', '.join(names)}), not ({', '.join(params)})"
    )


def sets(cls_name: str, fn, *attributes: str) -> None:
    """The class sets these attributes on its instances (in its source: they exist only once it has run)."""
    source = inspect.getsource(resolve(cls_name, fn))
    for attr in attributes:
        assert f"self.{attr}" in source, moved(f"{cls_name}.{attr}", fn)


def test_a_callback_queued_in_the_backward_pass_runs_after_the_whole_pass():
    order: list[str] = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: internals.queue_after_backward(lambda: order.append("end")) or order.append("hook"))
    x.register_hook(lambda g: order.append("leaf"))
    y.sum().backward()
    assert order == ["hook", "leaf", "end"], moved(
        "Variable._execution_engine.queue_callback", internals.queue_after_backward, "ran out of order"
    )


def test_ddp_bucket_assignment():
    resolve("torch.distributed._DEFAULT_FIRST_BUCKET_BYTES", internals.ddp_buckets)
    resolve("torch.distributed._compute_bucket_assignment_by_size", internals.ddp_buckets)  # C++: no signature
    params = [torch.zeros(2**18) for _ in range(4)]  # 1 MiB each
    buckets = internals.ddp_buckets(params, bucket_cap_mb=2)
    assert sorted(i for b in buckets for i in b) == [0, 1, 2, 3] and len(buckets) >= 2, buckets


def test_the_process_groups_default_store():
    takes("torch.distributed.distributed_c10d._get_default_store", internals.default_store)


def test_fsdp_collectives_in_use():
    resolve("torch.distributed.fsdp._fully_shard._fsdp_api.AllGather", internals.fsdp_comms)
    resolve("torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter", internals.fsdp_comms)
    takes("torch.distributed.fsdp.FSDPModule._get_fsdp_state", internals.fsdp_comms, "self")
    sets("torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState", internals.fsdp_comms, "_fsdp_param_groups")
    group = "torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup"
    sets(group, internals.fsdp_comms, "_all_gather_comm", "_reduce_scatter_comm", "_all_reduce_hook")
    assert isinstance(inspect.getattr_static(resolve(group, internals.fsdp_comms), "_is_hsdp"), property), moved(
        f"{group}._is_hsdp", internals.fsdp_comms, "is no property"
    )


def test_torch_compile_internals():
    internals.import_dynamo()
    takes("torch._dynamo.maybe_mark_dynamic", internals.mark_batch_dynamic, "t", "index")
    internals.mark_batch_dynamic(torch.zeros(4, 2))
    plain = torch.nn.Linear(2, 2)
    assert internals.uncompiled(plain) is plain
    assert internals.uncompiled(torch.compile(plain)) is plain, moved(
        "torch._dynamo.eval_frame.OptimizedModule._orig_mod", internals.uncompiled
    )
    handler = internals.compile_callbacks()
    for method in ("register_start_callback", "register_end_callback", "remove_start_callback", "remove_end_callback"):
        assert callable(getattr(handler, method, None)), moved(
            f"callback_handler.{method}", internals.compile_callbacks
        )


def test_persistent_loader_workers_stop_at_once():
    takes(
        "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._shutdown_workers",
        internals.stop_loader_workers,
        "self",
    )
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2, persistent_workers=True)
    next(iter(loader))
    workers = list(loader._iterator._workers)  # type: ignore[attr-defined]
    assert [w.is_alive() for w in workers] == [True, True]
    internals.stop_loader_workers(loader)
    assert loader._iterator is None and not any(w.is_alive() for w in workers), moved(
        "DataLoader._iterator", internals.stop_loader_workers, "no longer holds the persistent workers"
    )
    internals.stop_loader_workers(DataLoader(TensorDataset(torch.arange(8.0))))  # no workers: nothing to stop


def _shutting_down_as_a_worker_starts(worker_id: int) -> None:
    found = internals.loader_shutting_down()
    if found is None or found():
        raise RuntimeError(moved("_worker_loop's done_event", internals.loader_shutting_down, "was not found"))


def test_a_loader_worker_reads_whether_its_loader_is_shutting_down():
    params = inspect.signature(resolve("torch.utils.data._utils.worker._worker_loop", internals.loader_shutting_down))
    assert "done_event" in params.parameters, moved("_worker_loop's done_event", internals.loader_shutting_down)
    data = TensorDataset(torch.arange(4.0))
    loader = DataLoader(data, num_workers=1, worker_init_fn=_shutting_down_as_a_worker_starts)
    assert len(list(loader)) == 4  # the worker found the event, not set
    assert internals.loader_shutting_down() is None  # not in a worker


def test_torchrun_reads_its_command_line_through_config_from_args(monkeypatch):
    import torch.distributed.run as torchrun

    monkeypatch.setattr(torchrun, "config_from_args", torchrun.config_from_args)  # restored after
    takes("torch.distributed.run.config_from_args", internals.fork_torchrun_workers, "args")
    seen = []
    internals.fork_torchrun_workers(lambda config, cmd, args: seen.append((config, cmd, args)) or (config, cmd, args))
    torchrun.config_from_args(torchrun.parse_args(["--standalone", "--nproc-per-node=1", "-m", "ddplab", "env"]))
    [(config, _, args)] = seen
    assert hasattr(config, "start_method") and args[-3:] == ["-m", "ddplab", "env"], moved(
        "torch.distributed.run.config_from_args", internals.fork_torchrun_workers, f"returned {seen}"
    )


def test_the_agent_continues_each_worker_it_ends(monkeypatch):
    import multiprocessing
    import multiprocessing.process

    from torch.distributed.elastic.multiprocessing.api import PContext

    takes(
        "torch.distributed.elastic.multiprocessing.api.PContext.close",
        internals.continue_workers_it_ends,
        "self",
        "death_sig",
        "timeout",
    )
    takes("torch.distributed.elastic.multiprocessing.api.PContext.pids", internals.continue_workers_it_ends, "self")
    monkeypatch.setattr(PContext, "close", PContext.close)  # both restored after
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "terminate", multiprocessing.process.BaseProcess.terminate)
    internals.continue_workers_it_ends()
    stopped = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    stopped.start()
    os.kill(stopped.pid, signal.SIGSTOP)
    start = time.monotonic()
    stopped.terminate()  # SIGTERM, then SIGCONT: a stopped process acts on it
    stopped.join(10)
    assert stopped.exitcode == -signal.SIGTERM and time.monotonic() - start < 5, moved(
        "multiprocessing's Process.terminate", internals.continue_workers_it_ends, f"left it {stopped.exitcode}"
    )


def test_torchrun_names_its_rendezvous_events_through_get_method_name(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv

    mend = internals.name_rendezvous_events_cheaply
    takes("torch.distributed.elastic.rendezvous.dynamic_rendezvous.get_method_name", mend, "depth")
    for holder in ("DynamicRendezvousHandler", "_BackendRendezvousStateHolder", "_DistributedRendezvousOpExecutor"):
        assert "get_method_name()" in inspect.getsource(resolve(f"{rdzv.__name__}.{holder}._record", mend)), moved(
            f"{holder}._record", mend, "names its events otherwise"
        )
    torchs = rdzv.get_method_name
    monkeypatch.setattr(rdzv, "get_method_name", torchs)  # restored after
    mend()

    def record():  # as _record calls it: the name of the method that called _record
        return torchs(), rdzv.get_method_name()

    def next_state():
        return record()

    assert rdzv.get_method_name is not torchs and next_state() == ("next_state", "next_state")


def test_another_threads_frame():
    here = inspect.currentframe()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(internals.thread_frame(threading.main_thread().ident or 0)))
    thread.start()
    thread.join()
    frame, codes = seen[0], []  # the main thread waits in join(), called from here
    while frame is not None:
        codes.append(frame.f_code)
        frame = frame.f_back
    assert here is not None and here.f_code in codes, moved("sys._current_frames", internals.thread_frame, "lost")


def test_the_interpreters_exit_handlers_and_streams():
    """In a process of its own (the test's own exit handlers stay): handlers dropped, then run once; the
    streams written through; sys.argv as `python -m ddplab` sets it."""
    code = """
import atexit, os, sys
from pathlib import Path
from ddplab.engine.parallel import torch_internals as i
atexit.register(print, "dropped")
i.drop_exit_handlers()
atexit.register(print, "ran")
i.unbuffered_std_streams()
assert sys.stdout.write_through and sys.stderr.write_through
i.as_python_m(Path("ddplab/__main__.py"), ["train", "x=1"])
print(sys.argv)
i.run_exit_handlers()
os._exit(0)
"""
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n") == ["['ddplab/__main__.py', 'train', 'x=1']", "ran", ""], out.stdout


def test_a_forked_worker_names_the_packages_own_main_as_its_argv0():
    """The forked worker's sys.argv[0] is ddplab/__main__.py, what `python -m ddplab` names (the launcher's module
    lives a folder below the package)."""
    import ddplab
    from ddplab.commands.launch import PACKAGE_MAIN

    assert PACKAGE_MAIN == Path(ddplab.__file__).resolve().with_name("__main__.py") and PACKAGE_MAIN.is_file()


def test_torchfts_lighthouse_serves_without_importing_torch():
    """torchft's compiled Lighthouse, loaded by itself in a process where torch cannot be imported, answers on
    the port the system gave it; a replica group's quorum against it is test_replicas.py's."""
    pytest.importorskip("torchft", reason="needs torchft (pip install 'ddplab[ft]')")
    code = (
        "import sys, socket; sys.modules['torch'] = None\n"  # any import of torch raises
        "from ddplab.commands.launch import LIGHTHOUSE\n"
        "from ddplab.engine.parallel import torch_internals\n"
        "server = torch_internals.torchft_lighthouse(bind='[::]:0', **LIGHTHOUSE)\n"
        "port = int(server.address().rpartition(':')[2])\n"
        "socket.create_connection(('localhost', port), timeout=5).close()\n"
        "server.shutdown()\n"
        "print(port)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    what = f"does not serve: {out.stderr[-1000:]}"
    assert out.returncode == 0, moved("torchft._torchft.LighthouseServer", internals.torchft_lighthouse, what)
    assert int(out.stdout) > 0
