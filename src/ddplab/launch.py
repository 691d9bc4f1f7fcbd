"""Start N local worker processes through torch's own launcher (torch.distributed.run).

`ddplab train --nproc-per-node N` runs the torchrun agent as a child and stays in charge:

- SIGTERM, SIGINT and SIGUSR1 are forwarded to the agent as SIGTERM (the agent passes it
  to the workers, which snapshot and exit 75); the launcher waits and exits 75 too. A
  second signal kills the agent at once.
- Nothing outlives the launcher: the agent and each worker ask the kernel for SIGKILL
  when their parent dies (PR_SET_PDEATHSIG), so a SIGKILL of the launcher or of the agent
  leaves no worker behind.
- Workers report how they ended through files in a folder the launcher names
  (DDPLAB_REPORT_DIR): a user error is printed once, as one line, with exit 2, instead of
  torchrun's failure summary.

`python -m ddplab.launch ARGS` is torchrun with the parent-death signal set (the agent).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPORT_ENV = "DDPLAB_REPORT_DIR"
EXIT_PREEMPTED = 75  # the same as engine.preemption's; kept here so the launcher imports no torch
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def torchrun_command(nproc: int, args: list[str], *, max_restarts: int = 0, nnodes: int = 1,
                     node_rank: int | None = None, rdzv_endpoint: str | None = None, run_id: str | None = None,
                     agent_module: str = "torch.distributed.run") -> list[str]:
    cmd = [sys.executable, "-m", agent_module, f"--nproc-per-node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if run_id:
            cmd.append(f"--rdzv-id={run_id}")
        if node_rank is not None:
            cmd.append(f"--node-rank={node_rank}")
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    return cmd + ["-m", "ddplab"] + args


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux; a no-op elsewhere).

    If the parent is already gone (re-parented before the call), exit now."""
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


def quick_exit(code: int = 0) -> None:
    """End a process that has finished its work without the interpreter's teardown.

    Tearing down torch's modules takes 1.2-1.5 s on this machine (torch, torchvision and
    TensorBoard loaded; os._exit: 0.08 s), paid by every worker and by the agent, at the end of
    every command. The exit handlers run and standard streams are flushed first; every file ddplab
    writes is closed by then (a file a user's callback leaves open is not flushed: close it in
    on_train_end). Used only after a run completed, never on an error path."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def under_agent() -> bool:
    """This process is a worker started by a torchrun agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


# ------------------------------------------------------------------ worker side
def _report(name: str, text: str) -> bool:
    folder = os.environ.get(REPORT_ENV)
    if not folder or not Path(folder).is_dir():
        return False
    rank = os.environ.get("RANK", "0")
    tmp = Path(folder) / f".{name}-rank{rank}.tmp"
    tmp.write_text(text)
    os.replace(tmp, Path(folder) / f"{name}-rank{int(rank):05d}")
    return True


def report_error(message: str) -> bool:
    """A worker's user error, for the launcher to print once; False when no ddplab launcher listens."""
    return _report("error", message)


def report_preempted() -> None:
    _report("preempted", "")


# ------------------------------------------------------------------ launcher side
class _Forwarder:
    """Signal handlers of the launcher: the first signal asks the agent to stop cleanly, a second kills it."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.received: list[int] = []
        self._previous: dict = {}

    def install(self) -> "_Forwarder":
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)
        if self.proc.poll() is not None:
            return
        # The agent forwards SIGTERM to the workers and waits for them (SIGUSR1 would kill it).
        if len(self.received) == 1:
            self.proc.send_signal(signal.SIGTERM)
        else:
            self.proc.kill()

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _pump(stream, report: Path) -> None:
    """Copy the job's stderr through until a worker has reported a user error or a pre-emption:
    what follows is torchrun's failure summary or its SignalException traceback."""
    for line in iter(stream.readline, b""):
        if not any(report.iterdir()):
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
    stream.close()


def outcome(report: Path, agent_code: int) -> tuple[int, str | None]:
    """(exit code, one line to print) from what the workers reported."""
    errors = sorted(report.glob("error-rank*"))
    if errors:
        return 2, errors[0].read_text().strip()
    if any(report.glob("preempted-rank*")):
        return EXIT_PREEMPTED, None
    return (128 - agent_code if agent_code < 0 else agent_code), None  # killed by signal N: 128 + N, as a shell says


def run_workers(nproc: int, args: list[str], *, locked_run: str | None = None, **kwargs) -> int:
    """Run `ddplab <args>` in `nproc` processes; returns the job's exit code (75 when pre-empted)."""
    from ddplab.engine.lock import LOCKED_ENV

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="ddplab-launch-") as folder:
        report = Path(folder)
        env[REPORT_ENV] = folder
        if locked_run:
            env[LOCKED_ENV] = str(locked_run)
        cmd = torchrun_command(nproc, args, agent_module="ddplab.launch", **kwargs)
        # Its own session: a terminal's Ctrl-C reaches the launcher only, which stops the job cleanly.
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, start_new_session=True)
        forwarder = _Forwarder(proc).install()
        pump = threading.Thread(target=_pump, args=(proc.stderr, report), daemon=True)
        pump.start()
        try:
            code = proc.wait()
        finally:
            forwarder.restore()
        pump.join(timeout=10)
        code, line = outcome(report, code)
    if line:
        print(f"ddplab: error: {line}", file=sys.stderr)
    elif code == EXIT_PREEMPTED:
        print("ddplab: pre-empted; a snapshot was saved and the same command continues", file=sys.stderr)
    return code


if __name__ == "__main__":  # the agent: torchrun that dies with the launcher
    import runpy

    die_with_parent()
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    quick_exit(0)  # every worker succeeded (a failure raises above, and exits the usual way)
