"""The `ddplab` command: one line and exit 2 for bad input, one line and exit 1 for a failure at run time
(errors.py); never a traceback."""

from __future__ import annotations

import argparse
import importlib
import sys

from ddplab import __version__
from ddplab.config import describe_fields
from ddplab.engine.diagnosis.outcome import tell
from ddplab.errors import ExitCode, Preempted, RunError, UserError
from ddplab.registry import builtin_names
from ddplab.runtime import process_state


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too)
        print(f"ddplab: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(ExitCode.USAGE)


def _config_help() -> str:
    models, data = builtin_names()
    lines = [
        "built-in workloads (or your own file.py:function; see the docs, 'Your own workload'):",
        f"  model.name: {', '.join(models)}",
        f"  data.name:  {', '.join(data)}",
        "",
        "config fields (key=value):",
        *(f"  {name} = {default}  {help}" for name, default, help in describe_fields()),
    ]
    return "\n".join(lines)


TRUST = "import the run's own code although this machine has not trained with it (see 'Your own workload')"
FORCE = "let --output replace an existing file, or write inside a run folder"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ddplab", description="Distributed Data Parallel training with numbers you can trust.")
    p.add_argument("--version", action="version", version=f"ddplab {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser(
        "train",
        help="train a model (default: a character GPT on Shakespeare)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_config_help(),
    )
    t.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    t.add_argument("--nproc-per-node", type=int, help="launch N local processes (torch.distributed.run)")
    t.add_argument("--max-restarts", type=int, default=0, help="restart all workers up to K times after a failure")
    t.add_argument(
        "--replica-groups",
        type=int,
        help="run N replica groups with a torchft Lighthouse (distributed.fault_tolerance=replicas)",
    )

    g = sub.add_parser("generate", help="sample text from a trained language model")
    g.add_argument("run", help="run folder or checkpoint file")
    g.add_argument("--prompt", default="\n")
    g.add_argument("--max-new-tokens", type=int, default=300)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trust-code", action="store_true", help=TRUST)

    pr = sub.add_parser("predict", help="one row per input from a trained model: label and probability, values, ...")
    pr.add_argument("run", help="run folder or checkpoint file")
    pr.add_argument(
        "inputs", nargs="*", help="image files, texts, numbers (0.5,1.2), .npy/.pt files, or folders of them"
    )
    pr.add_argument("--file", help="read one input per line from this file")
    pr.add_argument("--batch-size", type=int, default=32)
    pr.add_argument("--top-k", type=int, help="classifiers: the K most probable labels and their probabilities")
    pr.add_argument("--output", help="also write every row with its input to this .csv or .jsonl file")
    pr.add_argument("--trust-code", action="store_true", help=TRUST)
    pr.add_argument("--force", action="store_true", help=FORCE)

    ex = sub.add_parser("export", help="the best (else last) model as one safetensors file, loadable without ddplab")
    ex.add_argument("run", help="run folder, snapshot folder or checkpoint file")
    ex.add_argument("--output", help="file to write (default: RUN/model.safetensors)")
    ex.add_argument("--force", action="store_true", help=FORCE)

    v = sub.add_parser("verify", help="check that N-process DDP matches one process with N x the batch")
    v.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    v.add_argument("--nproc", type=int, default=2)
    v.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed loss difference, relative")
    v.add_argument("--weight-tolerance", type=float, default=1e-4, help="largest allowed weight difference")

    st = sub.add_parser("study", help="sweep process counts and config values, one run folder per point, then report")
    st.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value]", help="key=value apply to every point")
    st.add_argument(
        "--nproc", default="1", help="process counts, e.g. 1,2,4 (per node), or 1x1,1x4,2x2 (nodes x processes)"
    )
    st.add_argument(
        "--nnodes", type=int, default=1, help="nodes for plain --nproc counts (several agents on loopback locally)"
    )
    st.add_argument(
        "--set",
        dest="sweeps",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="a swept config value; repeat for a grid",
    )
    st.add_argument("--name", help="study folder name (default: the config file's name, or 'study')")
    st.add_argument("--output-dir", default="experiments", help="folder that holds the study folder")
    st.add_argument("--budget", help="time budget for 'epochs @ budget' in the report (2h, 90m, 30s)")
    st.add_argument(
        "--repeat",
        type=int,
        help="run each point N times (same seed) and report medians with "
        "min-max; default: experiment.repeats of the config (1)",
    )

    ss = sub.add_parser(
        "status",
        help="a run folder's status; exit 0 complete, 75 pre-empted (requeue), 130 interrupted (Ctrl-C), 1 otherwise",
    )
    ss.add_argument("run", help="run folder")

    r = sub.add_parser("report", help="tables and plots (report.md, report.csv, PNGs) from run folders")
    r.add_argument("dirs", nargs="+", metavar="RUN_OR_STUDY_DIR")
    r.add_argument("--output", help="folder for the report (default: the folder given, or ./report for several)")
    r.add_argument("--force", action="store_true", help="let --output replace a report already there")
    r.add_argument(
        "--budget", help="time budget for 'epochs @ budget' (2h, 90m, 30s); default: the runs' training.time_budget"
    )

    sub.add_parser("env", help="what a bug report needs: versions, devices, extras, the launcher and its variables")

    f = sub.add_parser("forecast", help="predict step/epoch time, speedup and comm share of setups from run folders")
    f.add_argument("dirs", nargs="+", metavar="RUN_OR_STUDY_DIR")
    f.add_argument("--setups", default="1x1,2x1,4x1,8x1", help="nodes x processes per node, e.g. 1x1,2x1,4x1,8x1,2x8")
    f.add_argument("--bandwidth", help="inter-node bandwidth, e.g. 25Gbit or 3GB/s (default: fitted from the runs)")
    f.add_argument("--latency", help="inter-node latency per message, e.g. 50us (default: fitted from the runs)")
    f.add_argument(
        "--intra-bandwidth", help="bandwidth between the processes of a node, e.g. 200GB/s (default: fitted)"
    )
    f.add_argument("--budget", help="time budget for 'epochs @ budget' (2h, 90m, 30s)")
    f.add_argument("--batch-size", type=int, help="batch per process (default: the 1-process run's)")
    f.add_argument("--comm-hook", help="none, fp16, bf16, powersgd or powersgd:RANK (default: the runs')")
    f.add_argument("--strategy", help="ddp, fsdp, hsdp, or several comma-separated (default: the runs')")
    f.add_argument("--output", help="folder for forecast.md/.csv/.png (default: the folder given, or ./forecast)")
    return p


# Each module of ddplab.commands, with its commands (functions of the same name); a module is imported only when
# one of its commands is asked for.
MODULES = {
    "train": ("train", "verify", "status"),
    "inference": ("generate", "predict", "export"),
    "scaling": ("study", "report", "forecast"),
    "env": ("env",),
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    # Overrides may come after options too: `ddplab train --nproc-per-node 2 training.lr=1e-3`.
    if extra and hasattr(ns, "args") and not any(e.startswith("-") for e in extra):
        ns.args += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    ns.program = argv is None  # the command line's own process (`ddplab`, `python -m ddplab`), not a caller's
    try:
        with process_state.changes():  # called in a Python process of the user's: it is left as it was
            module = next(m for m, commands in MODULES.items() if ns.command in commands)
            return getattr(importlib.import_module(f"ddplab.commands.{module}"), ns.command)(ns)
    except UserError as err:
        tell("error", str(err), f"error: {err}")  # under `ddplab train --nproc-per-node`, the launcher prints it
        return err.exit_code
    except RunError as err:  # a failure at run time whose cause is known, recorded in the run folder
        tell("failure", f"failed: {err}")
        return err.exit_code
    except Preempted as stop:  # a job this command launched saved its snapshot (Interrupted: after a Ctrl-C)
        print(f"ddplab: {stop}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("ddplab: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
