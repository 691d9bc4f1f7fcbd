"""`python ARGS` for the suite, as a process forked from this test worker's warm server (tests/warm.py) instead of
a fresh interpreter: run as `python -S -E warm_stub.py SOCKET ARGS`, standard library only (10 ms to start).

It stands in for the process it asks for: it hands the server its arguments, environment, folder, standard streams
and resource limits, passes on every signal it gets to the forked process, asks the kernel for the parent-death
signal when that process asks for one, and ends as it ends (its exit code, or killed by the same signal). Killed
itself (SIGKILL), the server kills the forked process. Arguments the server does not run (options other than -u,
such as -c), and an environment that the server's imports would not see (READ_AT_IMPORT), are run by a fresh
interpreter, as they would be."""

import array
import ctypes
import json
import os
import resource
import signal
import socket
import struct
import sys

RECORD = struct.Struct("!cq")  # b"P" the forked process's pid, b"D" its parent-death signal, b"X" its wait status
LIMITS = ("RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_DATA")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


# What the server's Hugging Face libraries read from the environment when imported (their cache folders, offline
# switches): a process whose values differ from the server's runs in a fresh interpreter, which reads its own.
READ_AT_IMPORT = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "DATASETS_", "XDG_CACHE_HOME", "USE_T")


def read_at_import(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT)}


def warm_runs(args: list[str], server_env: dict) -> bool:
    while args[:1] == ["-u"]:
        args = args[1:]
    if read_at_import(os.environ) != server_env:
        return False
    return bool(args) and (args[0] == "-m" and len(args) > 1 or not args[0].startswith("-"))


def main() -> None:
    path, args = sys.argv[1], sys.argv[2:]
    with open(path + ".env") as f:
        server_env = json.load(f)
    if not warm_runs(args, server_env):
        os.execv(sys.executable, [sys.executable, *args])  # the venv's python, as the stub was started
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(path)
    limits = {name: resource.getrlimit(getattr(resource, name)) for name in LIMITS}  # a test's preexec_fn set them
    request = {"argv": args, "env": dict(os.environ), "cwd": os.getcwd(), "stub": os.getpid(), "limits": limits}
    request = json.dumps(request).encode()
    conn.sendmsg([b"R"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    conn.sendall(struct.pack("!I", len(request)) + request)
    pending: list[int] = []
    child = 0

    def forward(signum, frame):
        if child:
            os.kill(child, signum)
        else:
            pending.append(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    buffer = b""
    while True:
        data = conn.recv(4096)
        if not data:
            print("warm_stub: the warm server went away", file=sys.stderr)
            os._exit(1)
        buffer += data
        while len(buffer) >= RECORD.size:
            kind, value = RECORD.unpack(buffer[: RECORD.size])
            buffer = buffer[RECORD.size :]
            if kind == b"P":
                child = value
                for signum in pending:
                    os.kill(child, signum)
            elif kind == b"D":
                ctypes.CDLL(None).prctl(1, int(value), 0, 0, 0)  # PR_SET_PDEATHSIG
            else:
                code = os.waitstatus_to_exitcode(int(value))
                if code < 0:
                    if -code not in (signal.SIGKILL, signal.SIGSTOP):
                        signal.signal(-code, signal.SIG_DFL)
                    os.kill(os.getpid(), -code)
                os._exit(code)


if __name__ == "__main__":
    main()
