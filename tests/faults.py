"""Fault injection for the fault-tolerance tests: a callback, and a script that trains with it.

    python tests/faults.py SPEC train [CONFIG.yaml] [key=value ...]
    python tests/faults.py --agent --standalone --nproc-per-node=2 --max-restarts=1 tests/faults.py SPEC train ...
    python tests/faults.py --ranks 2 FOLDER tests/faults.py SPEC train ...

The script does what `ddplab train` does in one process of the job (through `ddplab.train`),
with `Faults(SPEC)` attached, so a failure happens at an exact point of a real run. With --agent it
is torchrun (the rest of the line is torchrun's), whose workers run the script (this one, or a user's)
forked from it, as `ddplab train --nproc-per-node` starts its own (ddplab.commands.launch.agent): a worker
then costs no import of torch. With --ranks N it is N workers as srun starts them, forked from it
likewise, no launcher watching them (`ranks`). SPEC is comma-separated `key=value` items; `step=S`
says when (after optimizer step S of the run):

  kill_rank=R,step=S      rank R sends itself SIGKILL (a worker that dies without a word)
  raise_rank=R,step=S     rank R raises RuntimeError (an ordinary crash)
  hang_rank=R,step=S      rank R stops taking part (sleeps until SIGTERM/SIGKILL ends it)
  signal_rank=R,step=S    rank R sends itself SIGUSR1 (or sig=TERM: SIGTERM), as SLURM does
                          before pre-emption
  nan_rank=R,step=S       rank R's model output (so its loss) of step S becomes NaN
  crash_before_marker=S   rank 0 dies after writing snapshot S's data, before its COMPLETE marker
  term_in_report=R        rank R sends itself SIGTERM while it composes a failure's report, as torchrun's agent
                          does when it ends the job of a rank that died
  trace=DIR               each rank appends "epoch index" for every sample it trains on to
                          DIR/rank<R>.txt (exact with data.num_workers=0, the default on CPU)

Faults fire only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT=0), so a
job restarted by `--max-restarts` runs clean; `trace` records in every attempt. The last three
wrap ddplab's own functions inside this process: the product has no hook for them.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import warm

import ddplab
from ddplab.cli import main as cli_main
from ddplab.engine.parallel import torch_internals

SCRIPT = Path(__file__).resolve()


def command(
    spec: str, args: list[str], nproc: int | None = None, max_restarts: int = 0, exec_workers: bool = False
) -> list[str]:
    """The command line of a faulty run: one process, or `nproc` under torchrun: the agent below, or with
    `exec_workers` plain torchrun (whose failure summary then records every worker's end, a SIGKILL included;
    the forked workers' summary, multiprocessing's, holds the first failure it sees)."""
    if nproc is None:
        return warm.command([sys.executable, str(SCRIPT), spec, *args])
    torchrun = [f"--nproc-per-node={nproc}", "--standalone", f"--max-restarts={max_restarts}"]
    if exec_workers:
        return warm.command([sys.executable, "-m", "torch.distributed.run", *torchrun, str(SCRIPT), spec, *args])
    return agent_command(torchrun, spec, args)


def ranks_command(n: int, folder: Path, spec: str, args: list[str]) -> list[str]:
    """The command line of `n` faulty workers started as srun starts them (`ranks`), their output in `folder`."""
    return forked_ranks(n, folder, [str(SCRIPT), spec, *args])


def forked_ranks(n: int, folder: Path, argv: list[str]) -> list[str]:
    """The command line of `n` workers started as srun starts them (`ranks`), each running `argv` (this script,
    `-m ddplab`, or a user's script: `_worker`), their output in `folder` (`ended`)."""
    return warm.command([sys.executable, str(SCRIPT), "--ranks", str(n), str(folder), *argv])


def ended(folder: Path, n: int) -> list[tuple[int, str, str, float]]:
    """What `ranks` left in `folder`: each rank's exit code, stdout, stderr and the time.time() it ended."""
    results = []
    for rank in range(n):
        code, at = (folder / f"rank{rank}.end").read_text().split()
        out, err = ((folder / f"rank{rank}.{name}").read_text() for name in ("out", "err"))
        results.append((int(code), out, err, float(at)))
    return results


def agent_command(torchrun_args: list[str], spec: str, args: list[str]) -> list[str]:
    """torchrun with `torchrun_args`, its workers this script's main() forked from it."""
    return forked_torchrun(torchrun_args, [str(SCRIPT), spec, *args])


def forked_torchrun(torchrun_args: list[str], argv: list[str]) -> list[str]:
    """torchrun with `torchrun_args` running `argv` (this script, `-m ddplab`, or a user's script: `_worker`, with
    its arguments) in workers forked from it, where plain torchrun starts a Python of their own for each."""
    return warm.command([sys.executable, str(SCRIPT), "--agent", *torchrun_args, *argv])


def agent(argv: list[str]) -> None:
    """torchrun (argv: its command line), whose workers are forked from it, as ddplab's own agent forks its
    `ddplab` workers: ddplab's forked-worker entry, with `_worker` where it calls the CLI's main()."""
    import torch._dynamo  # noqa: F401 - what every worker imports, imported once
    import torch.distributed.run as torchrun

    import ddplab.cli
    import ddplab.commands.run  # noqa: F401
    from ddplab.commands import launch

    ddplab.cli.main = _worker
    plain = torchrun.config_from_args

    def config_from_args(args):
        config, _, cmd_args = plain(args)  # cmd_args: ["-u", the script, its arguments...]
        config.start_method = "fork"
        return config, launch._forked_worker, cmd_args[1:]

    torchrun.config_from_args = config_from_args
    torch_internals.name_rendezvous_events_cheaply()  # as ddplab's agent: 0.4 s of CPU a rendezvous, names unchanged
    torchrun.main(argv)


class Faults(ddplab.Callback):
    def __init__(self, spec: str, rank: int, first_attempt: bool) -> None:
        self.items = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
        self.rank = rank
        self.armed = first_attempt

    def _fires(self, kind: str, step: int) -> bool:
        return (
            self.armed
            and f"{kind}_rank" in self.items
            and int(self.items[f"{kind}_rank"]) == self.rank
            and int(self.items.get("step", -1)) == step
        )

    def on_train_start(self, view) -> None:
        if "nan_rank" in self.items:

            def nan_output(module, inputs, output):  # during the step being taken (view.step + 1)
                if module.training and self._fires("nan", view.step + 1):
                    return output * float("nan")

            view.model.register_forward_hook(nan_output)

    def on_step_end(self, view) -> None:
        step = view.step
        if self._fires("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._fires("raise", step):
            raise RuntimeError(f"injected fault on rank {self.rank} after step {step}")
        if self._fires("signal", step):
            os.kill(os.getpid(), signal.Signals["SIG" + self.items.get("sig", "USR1")])
        if self._fires("hang", step):
            # A stuck rank: it ignores the job, but the launcher's SIGTERM still ends it.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(60)

    def patch(self, setattr=setattr) -> None:
        """The faults that happen inside ddplab's own functions, wrapped in this process only (with `setattr`: a
        test's monkeypatch.setattr undoes them)."""
        if self.armed and "crash_before_marker" in self.items:
            from ddplab.engine.snapshots import write as checkpoint

            write_marker, at = checkpoint.write_marker, int(self.items["crash_before_marker"])

            def crash_before_marker(folder, info):
                if info["step"] == at:
                    os.kill(os.getpid(), signal.SIGKILL)
                write_marker(folder, info)

            setattr(checkpoint, "write_marker", crash_before_marker)
        if self.armed and int(self.items.get("term_in_report", -1)) == self.rank:
            from ddplab.engine.diagnosis import heartbeat

            compose = heartbeat.compose

            def stopped_while_composing(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGTERM)
                return compose(*args, **kwargs)

            setattr(heartbeat, "compose", stopped_while_composing)
        if "trace" in self.items:
            from ddplab.data.sampler import ResumableDistributedSampler

            path = Path(self.items["trace"]) / f"rank{self.rank}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            indices = ResumableDistributedSampler.__iter__

            def traced(sampler):
                with open(path, "a", buffering=1) as f:
                    for key in indices(sampler):  # an index, or an (epoch, index) key for per-sample seeds
                        f.write(f"{sampler.epoch} {key[1] if isinstance(key, tuple) else key}\n")
                        yield key

            setattr(ResumableDistributedSampler, "__iter__", traced)


def _worker(argv: list[str]) -> int:
    """A forked worker (`agent`, `ranks`): this script's main(), ddplab's CLI (`-m ddplab ARGS`), or a user's
    script run as `python SCRIPT ARGS` runs it."""
    if argv[:2] == ["-m", "ddplab"]:
        sys.argv = [str(Path(ddplab.__file__).with_name("__main__.py")), *argv[2:]]  # as `python -m ddplab` has it
        return cli_main(argv[2:])
    script, args = Path(argv[0]).resolve(), argv[1:]
    if script == SCRIPT:
        return main(args)
    import runpy

    sys.argv, sys.path[0] = [str(script), *args], str(script.parent)
    runpy.run_path(str(script), run_name="__main__")
    return 0


def ranks(n: int, folder: str, argv: list[str]) -> int:
    """Ranks 0..n-1 of a job whose other variables (WORLD_SIZE, MASTER_ADDR, MASTER_PORT; or SLURM's) are this
    process's, each `_worker(argv)` in a process forked from this one, which only waits for them: no launcher
    watches them, as under srun. Each gets its RANK and LOCAL_RANK (SLURM_PROCID and SLURM_LOCALID in a job
    whose environment is SLURM's). Rank R's stdout and stderr go to FOLDER/rankR.out and FOLDER/rankR.err,
    and its end to FOLDER/rankR.end: its exit code (as subprocess gives it: -N for signal N) and the
    time.time() it ended. Returns in each rank (its exit code: the interpreter's exit follows, as in a process
    of its own), and never in this process."""
    import torch._dynamo  # noqa: F401 - what every worker imports, imported once

    import ddplab.commands.run  # noqa: F401

    workers = {}
    for rank in range(n):
        if (pid := os.fork()) == 0:
            names = ("SLURM_PROCID", "SLURM_LOCALID") if "SLURM_NTASKS" in os.environ else ("RANK", "LOCAL_RANK")
            os.environ.update(dict.fromkeys(names, str(rank)))
            for fd, name in ((1, "out"), (2, "err")):
                out = os.open(Path(folder, f"rank{rank}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(out, fd)
                os.close(out)
            return _worker(argv)
        workers[pid] = rank
    while workers:
        pid, status = os.wait()
        Path(folder, f"rank{workers.pop(pid)}.end").write_text(f"{os.waitstatus_to_exitcode(status)} {time.time()}")
    os._exit(0)  # this process's part is done: no teardown of torch to pay


def main(argv: list[str], setattr=setattr) -> int:
    """One process of the faulty run; in a test's process (one process, its 1-process runs), with `setattr` its
    monkeypatch.setattr."""
    spec, args = argv[0], argv[1:]
    if args[:1] == ["train"]:
        args = args[1:]
    config = args.pop(0) if args and "=" not in args[0] else None
    faults = Faults(spec, int(os.environ.get("RANK", "0")), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")
    faults.patch(setattr)
    try:
        summary = ddplab.train(config, args, callbacks=[faults])
    except ddplab.UserError as err:  # as `ddplab train` says it
        print(f"ddplab: error: {err}", file=sys.stderr)
        return err.exit_code
    stopped = {"preempted": ddplab.ExitCode.PREEMPTED, "interrupted": ddplab.ExitCode.INTERRUPTED}
    return stopped.get(summary["status"], ddplab.ExitCode.OK)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--agent"]:
        agent(sys.argv[2:])
    elif sys.argv[1:2] == ["--ranks"]:
        sys.exit(ranks(int(sys.argv[2]), sys.argv[3], sys.argv[4:]))
    else:
        sys.exit(main(sys.argv[1:]))
