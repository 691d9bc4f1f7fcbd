"""Every process ddplab starts (`train --nproc-per-node`, each point of `study`, both runs of `verify`) goes
through `run`, which stays in charge of the job:

- SIGTERM and SIGUSR1 reach the agents as SIGTERM (the workers snapshot, exit 75), SIGINT as SIGINT (exit 130);
  a second signal kills the agents. A stop signal sent to one worker stops the job so too (never restarted).
- Nothing outlives the launcher: agents, `srun` and workers each ask for SIGKILL when their parent dies.
- Workers report how they ended through files in runtime/handoff.py's report_dir: one line (exit 2 or 1)
  instead of torchrun's failure summary; a job no worker could report is marked failed by the launcher.

`python -m ddplab.commands.launch ARGS` is torchrun with the parent-death signal set (the agent).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections import deque
from pathlib import Path
from typing import NamedTuple

from ddplab.engine.diagnosis.outcome import STOPPING
from ddplab.engine.loop.preemption import STOPS, StopSignals
from ddplab.engine.parallel import torch_internals
from ddplab.engine.run_folder.files import open_append
from ddplab.engine.run_folder.folder import RunFiles, amend
from ddplab.errors import ExitCode, RunError, UserError, stopped
from ddplab.runtime.handoff import Handoff
from ddplab.runtime.process_state import die_with_parent, env_default

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_NOT_FAILED = (ExitCode.OK, ExitCode.PREEMPTED, ExitCode.INTERRUPTED)  # the job's exits that no failure explains
AGENT = [sys.executable, "-m", "ddplab.commands.launch"]
PACKAGE_MAIN = Path(__file__).resolve().parents[1] / "__main__.py"  # what `python -m ddplab` runs


def torchrun_command(
    nproc: int | str,
    args: list[str],
    *,
    max_restarts: int = 0,
    nnodes: int = 1,
    rdzv_endpoint: str | None = None,
    run_id: str | None = None,
    node_rank: int | None = None,
) -> list[str]:
    """The agent's command: torch's launcher, as `torchrun` takes it, running `ddplab ARGS`. With `node_rank`
    (a node placed by its own launcher: world.detect_nodes), torchrun's static rendezvous at `rdzv_endpoint`."""
    cmd = [*AGENT, f"--nproc-per-node={nproc}"]
    if nnodes == 1 and rdzv_endpoint is None:
        cmd.append("--standalone")
    elif node_rank is not None and rdzv_endpoint is not None:
        host, _, port = rdzv_endpoint.rpartition(":")
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={host}", f"--master-port={port}"]
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if run_id:
            cmd.append(f"--rdzv-id={run_id}")
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    return cmd + ["-m", "ddplab"] + args


def quick_exit(code: int = 0) -> None:
    """End a process that has finished its work without the interpreter's teardown: torch's takes 1.2-1.5 s
    (os._exit: 0.08 s), 10-19 s on 2 loaded cores. Exit handlers run and streams are flushed first (a file a
    user's callback leaves open is not: close it in on_train_end). Never on a worker's error path. A worker
    forked from its agent returns instead: its return value must reach the agent."""
    if _forked:
        return
    torch_internals.run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def log_tail(path: Path, lines: int = 12) -> str:
    """A failed job's log in brief: the workers' own error lines, then its end (the launcher's summary)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    errors = [line for line in dict.fromkeys(text) if line.startswith("ddplab: error") or "Error: " in line]
    return "\n".join((errors[:5] + ["..."] if errors else []) + text[-lines:])


def under_agent() -> bool:
    """This process is a worker started by a torchrun agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


class Ended(NamedTuple):
    code: int  # PREEMPTED / INTERRUPTED when the workers saved a snapshot, USAGE when one reported bad input
    error: str | None  # that user error, one line (USAGE), or the failure report (FAILED)
    stopped: bool  # a signal asked the job to stop
    root_cause: tuple[int, str] | None = None  # torchrun's "Root Cause" of a failure no worker reported (rank 0 killed)
    kind: str | None = None  # the stop's: "interrupted" (Ctrl-C) or "preempted"; None if no signal stopped it
    saved: bool = False  # the workers agreed on the stop and saved its snapshot


class _Job(StopSignals):
    """Agents started together (one per node; on loopback, several) and stopped together."""

    SIGNALS = FORWARDED

    def __init__(self, report: Path, log) -> None:
        super().__init__()
        self.report, self.log = report, log
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[threading.Thread] = []
        self.caught: list[int] = []  # every signal, in order
        self.tail: deque[str] = deque(maxlen=200)  # the agents' last stderr lines (torchrun's failure summary)
        self.requested = False  # a worker's stop signal, agreed and snapshotted by the ranks
        self._asked: set[int] = set()  # agents sent SIGTERM: a second one would cut their shutdown short

    def start(self, cmd: list[str], env: dict) -> None:
        if self.caught:
            return  # stopped while the others were starting
        if cmd[:3] != AGENT:
            cmd = [*AGENT, "--exec", *cmd]  # srun: it too must die with this process
        # Its own session: a terminal's Ctrl-C reaches the launcher only, which stops the job cleanly.
        proc = subprocess.Popen(
            cmd, env=env, stdout=self.log, stderr=self.log or subprocess.PIPE, start_new_session=True
        )
        self.procs.append(proc)
        if self.log is None:
            pump = threading.Thread(target=_pump, args=(proc.stderr, self.report, self.tail), daemon=True)
            pump.start()
            self.pumps.append(pump)

    def _handle(self, signum, frame) -> None:
        self.caught.append(signum)
        if len(self.caught) == 1:
            # Ctrl-C as itself (the workers record an interruption), any other stop as SIGTERM (SIGUSR1 would
            # kill an agent): the agent passes on the signal it received.
            return self._stop_agents(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
        for proc in (p for p in self.procs if p.poll() is None):
            proc.kill()

    def _stop_agents(self, sig: int = signal.SIGTERM) -> None:
        for proc in self.procs:
            if proc.poll() is None and proc.pid not in self._asked:
                self._asked.add(proc.pid)
                proc.send_signal(sig)
        (self.report / STOPPING).touch()

    def wait(self, independent: bool = False) -> int:
        """Until every agent has ended; the first to fail ends the others (`independent`: not, as replica
        groups go on without a failed one). The first failure's exit code, else 0."""
        while True:
            if not (self.caught or self.requested) and saved(self.report):
                self.requested = True  # the ranks agreed on a stop signal one of them received and snapshotted
                self._stop_agents()
            codes = [p.poll() for p in self.procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed and (not independent or None not in codes):
                return failed[0]  # run() stops the others
            if None not in codes:
                return 0
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[codes.index(None)].wait(timeout=0.1)

    def stop(self, grace: float = 30) -> None:
        self._stop_agents()
        for proc in self.procs:
            _end(proc, grace)
        for pump in self.pumps:
            pump.join(timeout=10)


# A log line of torchrun's agent handling a failure ("Sending process 123 closing signal SIGTERM"): what
# follows is its failure summary and traceback, which the launcher's one line or report replaces. torch names the
# file relative to sys.path, or whole where it cannot (a virtualenv reached through a symbolic link).
_AGENT_FAILING = re.compile(r"^[IWE]\d{4} [\d:.]+ \d+ (\S*/)?torch/distributed/elastic/")


def _pump(stream, report: Path, tail: deque) -> None:
    """Copy the job's stderr through until a worker has reported (a user error, a failure, a pre-emption)
    or torchrun's agent begins to handle a failure: what follows is its failure summary or traceback."""
    failing = False
    for line in iter(stream.readline, b""):
        tail.append(line.decode(errors="replace"))
        failing = failing or bool(_AGENT_FAILING.match(tail[-1]))
        if not failing and not any(report.glob("*-rank*")):
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
    stream.close()


def outcome(report: Path, agent_code: int, stopped: bool = False) -> tuple[int, str | None]:
    """(exit code, one line to print) from what the workers reported. Every agent ending with 0 is a job that
    ended well: a failure before torchrun restarted the workers is history, which train.log keeps."""
    if agent_code == 0 and not stopped:
        return ExitCode.OK, None
    if errors := sorted(report.glob("error-rank*")):
        return ExitCode.USAGE, errors[0].read_text().strip()
    if saved(report) == "interrupted":
        return ExitCode.INTERRUPTED, None
    if saved(report):
        return ExitCode.PREEMPTED, None
    if failures := sorted(report.glob("failure-rank*")):
        return ExitCode.FAILED, failures[0].read_text().strip()
    if stopped and agent_code:
        return ExitCode.INTERRUPTED, None  # stopped before the workers could save anything
    return (128 - agent_code if agent_code < 0 else agent_code), None  # killed by signal N: 128 + N, as a shell says


def saved(report: Path) -> str | None:
    """How the workers' agreed stop was recorded, its snapshot saved: "interrupted", "preempted" or None."""
    return next((status for status in reversed(STOPS) if any(report.glob(f"{status}-rank*"))), None)


def root_cause(lines) -> tuple[int, str] | None:
    """torchrun's first observed failure, from its summary: (0, "rank 0 (host h) died: Signal 9 (SIGKILL)
    received by PID 123") or (1, "rank 1 (host h) died: exit code 1")."""
    text = "".join(lines)
    section = text[text.find("Root Cause") :] if "Root Cause" in text else ""
    rank, host = re.search(r"rank\s*:\s*(\d+)", section), re.search(r"host\s*:\s*(\S+)", section)
    if rank is None:
        return None
    signal_ = re.search(r"traceback\s*:\s*(Signal .*)", section)
    code = re.search(r"exitcode\s*:\s*(-?\d+)", section)
    said = signal_.group(1).strip() if signal_ else f"exit code {code.group(1)}" if code else "ended"
    return int(rank.group(1)), f"rank {rank.group(1)}{f' (host {host.group(1)})' if host else ''} died: {said}"


def record_unreported(run_dir: Path, cause: tuple[int, str] | None) -> str:
    """A job that failed with no worker left to report it (rank 0 killed first): the launcher marks the run
    failed with what torchrun saw, so that `ddplab status` does not guess."""
    rank, said = cause or (None, "a worker died")
    summary = f"job failed: {said}; no rank could report (see {run_dir / 'train.log'} and {run_dir / 'logs'})"
    failure = {"summary": summary, "culprit": {"rank": rank}, "by": "launcher"}
    if (RunFiles(run_dir).summary() or {}).get("status") == "running":
        with contextlib.suppress(OSError, RunError):
            amend(run_dir, summary, status="failed", failure=failure)
    return summary


def run(
    commands: list[list[str]],
    *,
    log: Path | None = None,
    report_in: Path | None = None,
    env: dict | None = None,
    independent: bool = False,
) -> Ended:
    """Run agents (torchrun_command, or srun around one) until all end, forwarding signals to them. With `log`,
    their output is appended there; else stderr is copied through. `report_in`: a folder every node sees."""
    env = {**os.environ, **(env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="ddplab-launch-", dir=report_in) as folder, contextlib.ExitStack() as stack:
        report = Path(folder)
        env.update(Handoff(report_dir=folder).env())
        out = stack.enter_context(open_append(log.parent, log.name)) if log else None
        if out:
            more = f"   (and {len(commands) - 1} more agents)" if len(commands) > 1 else ""
            out.write(f"\n$ {' '.join(commands[0])}{more}\n")  # line-buffered: written before the agents start
        job = _Job(report, out)
        job.install()
        try:
            for cmd in commands:
                job.start(cmd, env)
            code = job.wait(independent)
        finally:
            job.stop()  # nothing is left running, whatever happened here; a second signal still kills
            job.restore()
        code, line = outcome(report, code, stopped := bool(job.caught) or job.requested)
        kind = agreed = saved(report)
        if out and line:
            out.write(f"ddplab: {'error: ' if code == ExitCode.USAGE else ''}{line}\n")
    if stopped and kind is None:  # the launcher's own signal stopped the job before its workers saved anything
        kind = "interrupted" if job.caught[:1] == [signal.SIGINT] else "preempted"
    return Ended(code, line, stopped, None if line or not code else root_cause(job.tail), kind, agreed is not None)


# The least each process needs: a worker holds about 290 MB once torch is imported (torch 2.x, CPU), before data.
PROCESS_MEMORY = 256 * 2**20


def check_processes(nproc: int, groups: int = 0) -> None:
    """The processes `--nproc-per-node` (x `--replica-groups`) starts here fit its memory: 10^5 of them would
    fork until the host ran out of memory."""
    count = nproc * max(groups, 1)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if count * PROCESS_MEMORY > total:
        asked = f"--replica-groups {groups} x --nproc-per-node {nproc}" if groups else f"--nproc-per-node {nproc}"
        raise UserError(
            f"{asked} starts {count} processes on this machine, each holding at least {PROCESS_MEMORY >> 20} MiB "
            f"once torch is imported; its {total / 2**30:.1f} GiB of memory holds {total // PROCESS_MEMORY} at most"
        )


def run_workers(nproc: int | str, args: list[str], *, env: dict | None = None, groups: int = 0, **kwargs) -> int:
    """Run `ddplab <args>` in `nproc` processes (`env`: added to this process's); the job's exit code. Raises
    Preempted (Interrupted after a Ctrl-C) when the workers saved a snapshot, UserError when one reported bad
    input. `groups`: that many replica groups, each its own agent, with a torchft Lighthouse here; a group that
    fails ends none of the others."""
    if groups:
        with lighthouse() as address:
            group = [f"distributed.replica_groups={groups}", f"distributed.lighthouse={address}"]
            overrides = [[*args, f"distributed.replica_group={i}", *group] for i in range(groups)]
            ended = run([torchrun_command(nproc, o, **kwargs) for o in overrides], env=env, independent=True)
    else:
        ended = run([torchrun_command(nproc, args, **kwargs)], env=env)
    if ended.error and ended.code == ExitCode.USAGE:
        raise UserError(ended.error)
    if ended.error:
        print(f"ddplab: {ended.error}", file=sys.stderr)
    elif (locked := Handoff.read(env or {}).locked_run) and ended.code not in _NOT_FAILED:
        print(f"ddplab: {record_unreported(Path(locked), ended.root_cause)}", file=sys.stderr)
    if ended.saved and ended.code in (ExitCode.PREEMPTED, ExitCode.INTERRUPTED):
        raise stopped(ended.kind or "preempted", "{stop}; a snapshot was saved and the same command continues")
    if ended.code == ExitCode.INTERRUPTED:
        print("ddplab: interrupted", file=sys.stderr)
    return ended.code


LIGHTHOUSE = {
    "min_replicas": 1,  # the groups left go on, however few
    "heartbeat_timeout_ms": 2000,  # a group silent this long is out of the next quorum
    "join_timeout_ms": 2000,  # how long a quorum waits for a group that is starting
    "quorum_tick_ms": 50,
}


@contextlib.contextmanager
def lighthouse():
    """A torchft Lighthouse in this process for the job's replica groups (its address), stopped after: on a port
    of the system's choosing (none to race for), and it ends with this process however that ends. Without torchft
    the job was refused before (registry.check_config)."""
    env_default("RUST_LOG", "warn")  # torchft's lines at each step, here and in the groups: info
    server = torch_internals.torchft_lighthouse(bind="[::]:0", **LIGHTHOUSE)
    try:
        yield f"http://localhost:{server.address().rpartition(':')[2]}"
    finally:
        server.shutdown()


def _end(proc: subprocess.Popen, grace: float) -> None:
    """Wait `grace` seconds for a process asked to stop, then kill it."""
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_forked = False  # this process is a worker forked from its agent (_forked_worker)


def agent() -> None:
    """torchrun, whose `-m ddplab` workers are forked from it with torch and ddplab already imported: importing
    them (torch._dynamo included) costs each worker 3.5 s of CPU, once per agent when forked. With a GPU device
    the workers are exec'd, as torchrun does, so that CUDA is never initialised before a fork."""
    import torch.distributed.run as torchrun  # the agent only: the launcher never imports torch

    if not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/dev/kfd").exists():

        def forked(config, cmd, cmd_args):
            if cmd_args[:3] != ["-u", "-m", "ddplab"]:
                return config, cmd, cmd_args
            torch_internals.import_dynamo()  # what every worker imports, imported once

            import ddplab.commands.run  # noqa: F401

            config.start_method = "fork"
            return config, _forked_worker, cmd_args[3:]

        torch_internals.fork_torchrun_workers(forked)
    torch_internals.continue_workers_it_ends()
    torch_internals.name_rendezvous_events_cheaply()
    torchrun.main()


def _forked_worker(*args: str) -> None:
    """`python -u -m ddplab ARGS` in a process forked from the agent: the agent's exit and signal handlers
    dropped, unbuffered output, and the teardown left to multiprocessing."""
    import torch  # in memory already, from the agent

    global _forked
    _forked = True
    torch_internals.drop_exit_handlers()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch_internals.unbuffered_std_streams()
    if (threads := os.environ.get("OMP_NUM_THREADS", "")).isdigit():
        torch.set_num_threads(int(threads))  # read by the agent's OpenMP when torch loaded, perhaps before it was set
    torch_internals.as_python_m(PACKAGE_MAIN, list(args))
    from ddplab.cli import main  # as `python -m ddplab` starts

    try:
        code = main(list(args))
    except Exception:  # noqa: BLE001 - as an exec'd worker's interpreter would, then exit 1
        traceback.print_exc()
        code = 1
    finally:
        torch_internals.run_exit_handlers()
    if code:
        raise SystemExit(code)


if __name__ == "__main__":  # the agent: torchrun that dies with the launcher; --exec CMD: CMD likewise
    die_with_parent()
    if sys.argv[1:2] == ["--exec"]:
        os.execvp(sys.argv[2], sys.argv[2:])  # the parent-death signal survives exec
    from ddplab.commands import launch  # this module under its own name, where the forked workers find _forked

    try:
        launch.agent()
    except Exception:  # noqa: BLE001 - torchrun's failure summary (ChildFailedError), printed as Python would
        traceback.print_exc()
        quick_exit(1)  # the workers have ended: the teardown (4-8 s on a loaded machine) would only delay the job's end
    quick_exit(0)  # every worker succeeded
