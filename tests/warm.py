"""Warm processes: the suite's jobs start from a server that has imported torch once, instead of a fresh
interpreter that imports it again.

Each launched job pays torch's import (with torch._dynamo, which every optimizer pulls in) in its agent, and under
plain torchrun in each worker: 6 s of CPU each on this machine, most of a short job. One server per test worker
(`server`) imports it once; `command(cmd)` turns `python ARGS` into a stub (tests/warm_stub.py) that has the server
fork a process running ARGS as `python ARGS` would, with the stub's arguments, environment, folder and standard
streams. A process forked so starts its own `python` children (an agent's, a launcher's) the same way.

What differs from a fresh interpreter: torch, ddplab, transformers, datasets and their imports are loaded already
(the Hugging Face libraries read their cache and offline settings then: a process whose settings differ from the
server's runs cold, warm_stub.READ_AT_IMPORT; the string-hash salt is the server's), the process's parent is the
server (the stub stands in for it: signals, parent death, resource limits and exit status pass through it), its pid
is not the stub's, and it ends without the interpreter's teardown (exit handlers run, then os._exit, as ddplab's own
workers end). `tagged`, `stands_for` and `children` find a job's processes across stubs. Tests about parent death,
pids, process groups, the salt or an abort in the teardown run their processes cold: COLD lists their files,
`cold=True` a call of conftest's helpers, and `DDPLAB_TESTS_WARM=0` runs the whole suite cold.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

from warm_stub import read_at_import, warm_runs

HERE = Path(__file__).resolve().parent
STUB = HERE / "warm_stub.py"
RECORD = struct.Struct("!cq")  # as warm_stub.RECORD
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.run",
    "rich",
    "ddplab.cli",
    "ddplab.commands.run",
    "ddplab.commands.launch",
    "ddplab.commands.train",
    "ddplab.workloads.char_lm",
    "ddplab.models.gpt",
    "transformers",
    "transformers.modeling_utils",
    "datasets",
)

# Files whose tests look at processes themselves (pids, /proc, process groups, parent death): cold processes.
COLD = {
    "test_process_state.py",
    "test_torch_internals.py",
    "test_dist.py",
    "test_extras.py",
}

# A test's mark on the processes of one job, in their environment (tagged).
TAG = "DDPLAB_TEST_TAG"

_server: subprocess.Popen | None = None
_socket: str | None = None


def enabled() -> bool:
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[0]
    return os.environ.get("DDPLAB_TESTS_WARM", "1") != "0" and Path(test).name not in COLD


def command(cmd: list[str], cold: bool = False) -> list[str]:
    """`cmd` (`python ARGS`) as it runs warm: the stub, with this test worker's server started if need be.
    `cold`: as it is (a test of what differs, e.g. the string-hash salt each fresh interpreter draws)."""
    if cold or not cmd or cmd[0] != sys.executable or cmd[3:4] == [str(STUB)] or not enabled():
        return cmd
    _start()
    return _stubbed(cmd)


def _stubbed(cmd) -> list[str]:
    return [sys.executable, "-S", "-E", str(STUB), _socket, *cmd[1:]]


@contextlib.contextmanager
def processes():
    """Within: every `python ARGS` this process starts (subprocess) runs warm (an in-process launcher's agents)."""
    if not enabled():
        yield
        return
    _start()
    subprocess.Popen._execute_child = _warm_execute_child  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen._execute_child = _plain_execute_child  # type: ignore[method-assign]


_plain_execute_child = subprocess.Popen._execute_child


def _warm_execute_child(self, args, executable, *rest):
    if executable is None and isinstance(args, (list, tuple)) and args and args[0] == sys.executable:
        args = _stubbed(args)
    return _plain_execute_child(self, args, executable, *rest)


def tagged(tag: str) -> list[int]:
    """The live processes of the job marked `tag`: those started with TAG=tag in their environment (cold ones,
    stubs; zombies have none), the processes stubs stand for, and their descendants. A forked process's environment
    in /proc is the server's, and torch renames its agent (/proc/PID/comm): neither can mark it."""
    parents: dict[int, int] = {}
    roots = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                if f"{TAG}={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    roots.append(int(entry.name))
    kids: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        kids.setdefault(parent, []).append(pid)
    found: set[int] = set()
    while roots:
        pid = roots.pop()
        if pid in found or pid not in parents:
            continue
        found.add(pid)
        roots += [stands_for(pid), *kids.get(pid, ())]
    return sorted(found)


def stands_for(pid: int) -> int:
    """The process a stub stands for (the pid the server forked for it); any other process, itself."""
    if _socket is not None:
        for entry in Path(_stubs()).glob("*"):
            with contextlib.suppress(OSError, ValueError):
                if int(entry.read_text()) == pid:
                    return int(entry.name)
    return pid


def children(pid: int) -> list[int]:
    """A process's children, or for a stub those of the process it stands for."""
    pid = stands_for(pid)
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _start() -> str:
    global _server, _socket
    if _server is not None and _server.poll() is None:
        return _socket
    folder = tempfile.mkdtemp(prefix="ddplab-warm-")
    _socket = os.path.join(folder, "socket")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    log = open(os.path.join(folder, "server.log"), "w")  # noqa: SIM115 - the server's, kept open with it
    _server = subprocess.Popen(
        [sys.executable, str(Path(__file__)), _socket],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not os.path.exists(_socket + ".ready"):
        if _server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the warm server did not start: {Path(folder, 'server.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return _socket


def stop() -> None:
    """End this test worker's server, and remove its folder (its socket and log)."""
    if _server is not None and _server.poll() is None:
        _server.kill()
        _server.wait()
    if _socket is not None:
        import shutil

        shutil.rmtree(os.path.dirname(_socket), ignore_errors=True)


# ------------------------------------------------------------------------------------------------- the server
def serve(path: str) -> None:
    """Import torch and ddplab, then fork a process for each stub that connects, until this process is killed
    (or its test worker ends)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG: ends with its test worker
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    global _socket, _plain_die
    for module in ("ddplab.runtime.process_state", "ddplab.commands.launch", "ddplab.commands.train"):
        _plain_die = sys.modules[module].die_with_parent
        sys.modules[module].die_with_parent = _die_with_stub
    import ddplab.engine.run_folder.lock as lock

    lock._ancestors = _ancestors
    subprocess.Popen._execute_child = _warm_execute_child  # type: ignore[method-assign]
    _socket = path
    os.mkdir(_stubs())
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    # forked pid -> (connection to its stub, the stub's pidfd, the forked process's pidfd)
    forked: dict[int, tuple[socket.socket, int, int]] = {}
    import gc

    gc.freeze()  # what was imported here is never collected: a process's exit collects only what it made
    global _server_env, _site_path
    _server_env = read_at_import(os.environ)
    known = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    _site_path = [p for p in sys.path[1:] if p not in known]  # a fresh interpreter's, without the server's folder
    os.execvp = _execvp
    Path(path + ".env").write_text(json.dumps(_server_env))
    Path(path + ".ready").touch()
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _read_request(conn)
                    stub = os.pidfd_open(request["stub"])
                except (OSError, EOFError, ValueError):  # a stub that went away before it asked
                    conn.close()
                    continue
                inherited = [listener.fileno(), selector.fileno()]
                inherited += [stub, *(fd for c, s, p in forked.values() for fd in (c.fileno(), s, p))]
                pid = os.fork()
                if pid == 0:
                    _become(conn, fds, request, inherited)  # never returns
                Path(_stubs(), str(pid)).write_text(str(request["stub"]))
                for fd in fds:
                    os.close(fd)
                conn.sendall(RECORD.pack(b"P", pid))
                child = os.pidfd_open(pid)
                forked[pid] = (conn, stub, child)
                selector.register(stub, selectors.EVENT_READ, ("stub", pid))
                selector.register(child, selectors.EVENT_READ, ("child", pid))
                continue
            what, pid = key.data
            if what == "stub":  # the stub was killed: so is the process it stands for
                selector.unregister(key.fd)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                continue
            _, status = os.waitpid(pid, 0)
            conn, stub, child = forked.pop(pid)
            with contextlib.suppress(OSError):
                conn.sendall(RECORD.pack(b"X", status))
            for fd in (stub, child):
                with contextlib.suppress(KeyError, ValueError):
                    selector.unregister(fd)
                os.close(fd)
            conn.close()
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(_stubs(), str(pid)))


def _stubs() -> str:
    """The folder that names each forked process's stub (a file named by the forked pid)."""
    return _socket + ".stubs"


def _ancestors() -> set[int]:
    """lock._ancestors across stubs: the processes above this one, a forked process's stub and the processes
    above the stub standing where the server would (ddplab's launcher checks that it is above its workers)."""
    found, pid = set(), os.getpid()
    while pid > 1:
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
            if parent == _server_pid:
                parent = int(Path(_stubs(), str(pid)).read_text())
        except (OSError, ValueError, IndexError):
            break
        if parent <= 1 or parent in found:
            break
        found.add(parent)
        pid = parent
    return found


_server_pid = os.getpid()  # in the server and every process forked from it


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    import array

    fds = array.array("i")
    _, ancillary, _, _ = conn.recvmsg(1, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    size = struct.unpack("!I", _exactly(conn, 4))[0]
    return json.loads(_exactly(conn, size)), list(fds)


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError("the stub went away")
        data += chunk
    return data


_plain_die = None  # ddplab's die_with_parent
_stub_conn: socket.socket | None = None
_server_env: dict = {}  # the server's settings that its imports read (warm_stub.READ_AT_IMPORT)
_site_path: list[str] = []  # sys.path as a fresh interpreter starts it, less its first entry and PYTHONPATH's
_plain_execvp = os.execvp
_stub_pid = 0  # the process that stands for its stub (its forked children are plain processes)


def _die_with_stub(sig: int = signal.SIGKILL) -> None:
    """die_with_parent for a process forked for a stub: the stub asks for the parent-death signal (its parent is
    the forked process's), and passes it on; a process forked by that one asks the kernel, as it would."""
    if os.getpid() == _stub_pid and _stub_conn is not None:
        _stub_conn.sendall(RECORD.pack(b"D", int(sig)))
        return
    _plain_die(sig)


def _become(conn: socket.socket, fds: list[int], request: dict, close: list[int]) -> None:
    """In the forked process: become `python ARGS` as the stub was started, run it, and end as it would."""
    global _stub_conn, _stub_pid
    try:
        os.setpgid(0, 0)
        for fd in close:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _stub_conn, _stub_pid = conn, os.getpid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import resource

        for name, limit in request["limits"].items():
            if resource.getrlimit(getattr(resource, name)) != tuple(limit):
                resource.setrlimit(getattr(resource, name), tuple(limit))
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        _end(1)
    _python(list(request["argv"]))


def _python(args: list[str]) -> None:
    """Run `python ARGS` in this process as a fresh interpreter would (its streams, sys.path and __main__), and
    end as it would."""
    code = 1
    try:
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        while args[0] == "-u":
            unbuffered, args = True, args[1:]
        _streams(unbuffered)
        if (threads := os.environ.get("OMP_NUM_THREADS", "")).isdigit():
            import torch

            torch.set_num_threads(int(threads))
        added = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        first = os.getcwd() if args[0] == "-m" else str(Path(args[0]).resolve().parent)
        sys.path[:] = [first, *added, *_site_path]
        sys.modules["__main__"] = types.ModuleType("__main__")
        code = _run(args)
    except SystemExit as exit:
        code = _exit_code(exit.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        _end(code)


def _execvp(file: str, args: list[str]) -> None:
    """os.execvp in a forked process: `python ARGS` that the stub would run warm runs in this process instead of
    a fresh interpreter (the launcher's `--exec` hop, which a 1-process verify run takes); the rest is exec'd."""
    if file == sys.executable and warm_runs(list(args[1:]), _server_env):
        _python(list(args[1:]))
    _plain_execvp(file, args)


def _run(args: list[str]) -> int:
    import runpy

    if args[0] == "-m":
        sys.modules.pop(args[1], None)  # as in a fresh interpreter, where the module `-m` runs is not imported yet
        sys.argv = ["-m", *args[2:]]
        runpy._run_module_as_main(args[1], alter_argv=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")
    return 0


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _streams(unbuffered: bool) -> None:
    import io

    def text(fd: int, mode: str, **options):
        raw = io.FileIO(fd, mode, closefd=False)
        if mode == "rb":
            return io.TextIOWrapper(io.BufferedReader(raw), **options)
        layer = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(layer, write_through=unbuffered, **options)

    tty = os.isatty(1)
    sys.stdin = sys.__stdin__ = text(0, "rb", encoding="utf-8")
    sys.stdout = sys.__stdout__ = text(1, "wb", encoding="utf-8", line_buffering=tty)
    sys.stderr = sys.__stderr__ = text(2, "wb", encoding="utf-8", errors="backslashreplace", line_buffering=True)


def _end(code: int) -> None:
    """What the interpreter does at its exit, without its teardown: threads joined, exit handlers run, files
    flushed; killed by the signal that ended it (KeyboardInterrupt: SIGINT, as Python does)."""
    import atexit
    import gc
    import threading

    with contextlib.suppress(BaseException):
        threading._shutdown()
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    serve(sys.argv[1])
