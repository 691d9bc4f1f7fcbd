"""The `ddplab` command: one line and exit 2 for bad input, never a traceback."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddplab.errors import UserError
from ddplab.extras import require


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too)
        print(f"ddplab: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] [key=value ...]`: the first item without '=' is the config file."""
    config, overrides = None, []
    for item in items:
        if "=" in item:
            overrides.append(item)
        elif config is None:
            config = item
        else:
            raise UserError(f"unexpected argument '{item}': only one config file, then key=value overrides")
    return config, overrides


def _config_help() -> str:
    from ddplab.config import describe_fields
    from ddplab.registry import builtin_names

    models, data = builtin_names()
    lines = ["built-in workloads (or your own file.py:function; see the docs, 'Your own workload'):",
             f"  model.name: {', '.join(models)}", f"  data.name:  {', '.join(data)}", "",
             "config fields (key=value):"]
    lines += [f"  {name} = {default}  {help}" for name, default, help in describe_fields()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ddplab", description="Distributed Data Parallel training with numbers you can trust.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a model (default: a character GPT on Shakespeare)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_config_help())
    t.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    t.add_argument("--nproc-per-node", type=int, default=None, help="launch N local processes (torch.distributed.run)")
    t.add_argument("--max-restarts", type=int, default=0, help="restart all workers up to K times after a failure")

    g = sub.add_parser("generate", help="sample text from a trained language model")
    g.add_argument("run", help="run folder or checkpoint file")
    g.add_argument("--prompt", default="\n")
    g.add_argument("--max-new-tokens", type=int, default=300)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--trust-code", action="store_true", help="import the run's model code even from outside this directory")

    pr = sub.add_parser("predict", help="one row per input from a trained model: label and probability, values, ...")
    pr.add_argument("run", help="run folder or checkpoint file")
    pr.add_argument("inputs", nargs="*", help="image files, texts, numbers (0.5,1.2), .npy/.pt files, or folders of them")
    pr.add_argument("--file", help="read one input per line from this file")
    pr.add_argument("--batch-size", type=int, default=32)
    pr.add_argument("--top-k", type=int, help="classifiers: the K most probable labels and their probabilities")
    pr.add_argument("--output", help="also write every row with its input to this .csv or .jsonl file")
    pr.add_argument("--trust-code", action="store_true", help="import the run's model code even from outside this directory")

    v = sub.add_parser("verify", help="check that N-process DDP matches one process with N x the batch")
    v.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value]")
    v.add_argument("--nproc", type=int, default=2)
    v.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed loss difference, relative")
    v.add_argument("--weight-tolerance", type=float, default=1e-4, help="largest allowed weight difference")

    st = sub.add_parser("study", help="sweep process counts and config values, one run folder per point, then report")
    st.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value]", help="key=value apply to every point")
    st.add_argument("--nproc", default="1", help="process counts, e.g. 1,2,4 (per node), or 1x1,1x4,2x2 (nodes x processes)")
    st.add_argument("--nnodes", type=int, default=1, help="nodes for plain --nproc counts (several agents on loopback locally)")
    st.add_argument("--set", dest="sweeps", action="append", default=[], metavar="KEY=V1,V2",
                    help="a swept config value; repeat for a grid")
    st.add_argument("--name", help="study folder name (default: the config file's name, or 'study')")
    st.add_argument("--output-dir", default="experiments", help="folder that holds the study folder")
    st.add_argument("--budget", help="time budget for 'epochs @ budget' in the report (2h, 90m, 30s)")
    st.add_argument("--repeat", type=int, help="run each point N times (same seed) and report medians with "
                    "min-max; default: experiment.repeats of the config (1)")

    ss = sub.add_parser("status", help="a run folder's status; exit 0 complete, 75 pre-empted (requeue), 1 otherwise")
    ss.add_argument("run", help="run folder")

    r = sub.add_parser("report", help="tables and plots (report.md, report.csv, PNGs) from run folders")
    r.add_argument("dirs", nargs="+", metavar="RUN_OR_STUDY_DIR")
    r.add_argument("--output", help="folder for the report (default: the folder given, or ./report for several)")
    r.add_argument("--budget", help="time budget for 'epochs @ budget' (2h, 90m, 30s); default: the runs' training.time_budget")

    f = sub.add_parser("forecast", help="predict step/epoch time, speedup and comm share of setups from run folders")
    f.add_argument("dirs", nargs="+", metavar="RUN_OR_STUDY_DIR")
    f.add_argument("--setups", default="1x1,2x1,4x1,8x1", help="nodes x processes per node, e.g. 1x1,2x1,4x1,8x1,2x8")
    f.add_argument("--bandwidth", help="inter-node bandwidth, e.g. 25Gbit or 3GB/s (default: fitted from the runs)")
    f.add_argument("--latency", help="inter-node latency per message, e.g. 50us (default: fitted from the runs)")
    f.add_argument("--intra-bandwidth", help="bandwidth between the processes of a node, e.g. 200GB/s (default: fitted)")
    f.add_argument("--budget", help="time budget for 'epochs @ budget' (2h, 90m, 30s)")
    f.add_argument("--batch-size", type=int, help="batch per process (default: the 1-process run's)")
    f.add_argument("--comm-hook", help="none, fp16, bf16, powersgd or powersgd:RANK (default: the runs')")
    f.add_argument("--output", help="folder for forecast.md/.csv/.png (default: the folder given, or ./forecast)")
    return p


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UserError(f"{name} must be >= 1, got {value}")


def cmd_train(ns) -> int:
    from ddplab.registry import check_files, checked_without_torch, load_config

    config, overrides = split_args(ns.args)
    cfg = load_config(config, overrides)
    check_files(cfg)
    _positive("--nproc-per-node", ns.nproc_per_node)
    if ns.max_restarts < 0:
        raise UserError(f"--max-restarts must be >= 0, got {ns.max_restarts}")
    if ns.nproc_per_node or ns.max_restarts:
        from ddplab.engine.lock import claim, resolve_run_dir
        from ddplab.launch import run_workers
        from ddplab.metrics.phases import note_launch

        if not checked_without_torch(cfg):
            preflight(cfg)
        # The launcher owns the run folder for the whole job, restarts included.
        lock, (run_dir, note, error) = claim(cfg, resolve_run_dir(cfg))
        if error:
            raise UserError(error)
        try:
            if note:
                print(note, flush=True)
            note_launch()  # the workers' start-up breakdown begins at this process's start
            return run_workers(ns.nproc_per_node or 1, ["train", *ns.args], max_restarts=ns.max_restarts,
                               locked_run=str(run_dir))
        finally:
            lock.release()
    from ddplab.launch import die_with_parent, quick_exit, report_preempted, under_agent

    if under_agent():
        die_with_parent()  # a worker never outlives its torchrun agent
    from torch.distributed.elastic.multiprocessing.errors import record

    from ddplab.engine.preemption import EXIT_PREEMPTED
    from ddplab.run import train

    # record(): under torchrun, the failing rank's exception is written where the launcher
    # prints it in its failure summary.
    summary = record(train)(cfg)
    if summary["status"] == "preempted":
        report_preempted()
        return EXIT_PREEMPTED
    if under_agent():
        quick_exit(0)  # the run is recorded and its files closed
    return 0


def preflight(cfg) -> None:
    """In the launcher, for a workload without torch-free checks: build its data and model once on
    the CPU, so that bad code fails in one line before any worker starts."""
    import torch  # the launcher imports torch only for such a workload

    from ddplab.distributed import DistContext, LaunchInfo
    from ddplab.engine.rng import seed_everything
    from ddplab.engine.setup import build_data, build_model
    from ddplab.registry import workload

    seed_everything(cfg.experiment.seed)
    ctx = DistContext(LaunchInfo("none"), None, torch.device("cpu"))
    work = workload(cfg)
    build_model(cfg, ctx, work, build_data(cfg, ctx, work))


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    """temperature 0 is greedy decoding and top-k 0 means no top-k; negative values are refused."""
    _positive("--max-new-tokens", max_new_tokens)
    if not temperature >= 0:  # NaN too
        raise UserError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise UserError(f"--top-k must be >= 0 (0 = no top-k), got {top_k}")


def cmd_generate(ns) -> int:
    from ddplab.inference import load_model, sample

    _check_sampling(ns.max_new_tokens, ns.temperature, ns.top_k)
    model, ckpt, _ = load_model(ns.run, ns.trust_code)
    print(sample(model, ckpt.get("meta", {}), ns.prompt, ns.max_new_tokens, ns.temperature, ns.top_k, ns.seed))
    return 0


def cmd_predict(ns) -> int:
    from ddplab.predict import expand, line, output_format, predict, write

    items = list(ns.inputs)
    if ns.file:
        if not Path(ns.file).is_file():
            raise UserError(f"--file: no such file: {ns.file}")
        items += [line.rstrip("\n") for line in open(ns.file, encoding="utf-8") if line.strip()]
    if not items:
        raise UserError("predict: give inputs on the command line or --file")
    _positive("--batch-size", ns.batch_size)
    _positive("--top-k", ns.top_k)
    if ns.output:
        output_format(ns.output)  # a wrong name is refused before the model is built
    rows = predict(ns.run, expand(items), ns.batch_size, ns.top_k, ns.trust_code)
    for row in rows:
        print(line(row))
    if ns.output:
        write(rows, ns.output)
    return 0


def cmd_verify(ns) -> int:
    from ddplab.verify import verify

    _positive("--nproc", ns.nproc)
    config, overrides = split_args(ns.args)
    return verify(config, overrides, ns.nproc, ns.tolerance, ns.weight_tolerance)


def cmd_study(ns) -> int:
    from ddplab.config_io import parse_duration
    from ddplab.report.build import make_report
    from ddplab.study.grid import expand, parse_setups, parse_sweeps
    from ddplab.study.runner import run_study

    from ddplab.registry import load_config

    config, common = split_args(ns.args)
    _positive("--nnodes", ns.nnodes)

    budget = parse_duration(ns.budget, "--budget")
    _positive("--repeat", ns.repeat)
    repeat = ns.repeat or load_config(config, common).experiment.repeats
    name = ns.name or (Path(config).stem if config else "study")
    study_dir = Path(ns.output_dir) / name
    points = expand(config, common, parse_setups(ns.nproc, ns.nnodes), parse_sweeps(ns.sweeps), str(study_dir), repeat)
    grid = len({p.point for p in points})
    from ddplab.engine.lock import RunLock

    # One study per folder; each point also locks its own run folder.
    with RunLock(study_dir, what="study folder", names="--output-dir or --name"):
        print(f"study {name}: {grid} points" + (f" x {repeat} repeats" if repeat > 1 else "") + f" -> {study_dir}")
        run_study(study_dir, config, points)
        report = make_report([study_dir], study_dir, budget)
        from ddplab.trackers import finish_study

        finish_study(study_dir, study_dir)  # the points' parent MLflow run gets the report, then ends
    print(f"report: {report}")
    return 0


def cmd_report(ns) -> int:
    require("report", "ddplab report")
    from ddplab.config_io import parse_duration
    from ddplab.report.build import make_report

    budget = parse_duration(ns.budget, "--budget")
    out = ns.output or (ns.dirs[0] if len(ns.dirs) == 1 else "report")
    print(f"report: {make_report(ns.dirs, out, budget)}")
    return 0


def cmd_status(ns) -> int:
    """For requeue scripts under plain torchrun, whose own exit code cannot say 'pre-empted'."""
    import json

    path = Path(ns.run) / "metrics.json"
    if not path.is_file():
        raise UserError(f"no run folder at {ns.run} (no metrics.json)")
    try:
        status = json.loads(path.read_text()).get("status", "unknown")
    except (OSError, ValueError, AttributeError):
        raise UserError(f"{path} is not a ddplab metrics.json") from None
    print(status)
    return {"complete": 0, "preempted": 75}.get(status, 1)


def cmd_forecast(ns) -> int:
    require("report", "ddplab forecast")
    from ddplab.forecast import Options, make_forecast

    opts = Options(ns.setups, ns.bandwidth, ns.latency, ns.intra_bandwidth, ns.budget, ns.batch_size, ns.comm_hook)
    out = ns.output or (ns.dirs[0] if len(ns.dirs) == 1 else "forecast")
    path = make_forecast(ns.dirs, out, opts)
    print(path.read_text(), end="")
    print(f"forecast: {path}")
    return 0


COMMANDS = {"train": cmd_train, "generate": cmd_generate, "predict": cmd_predict, "verify": cmd_verify,
            "study": cmd_study, "report": cmd_report,
            "forecast": cmd_forecast, "status": cmd_status}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    # Overrides may come after options too: `ddplab train --nproc-per-node 2 training.lr=1e-3`.
    if extra:
        if hasattr(ns, "args") and not any(e.startswith("-") for e in extra):
            ns.args += extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return COMMANDS[ns.command](ns)
    except UserError as err:
        from ddplab.launch import report_error

        if not report_error(str(err)):  # under `ddplab train --nproc-per-node`, the launcher prints it once
            print(f"ddplab: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("ddplab: interrupted", file=sys.stderr)
        return 130
