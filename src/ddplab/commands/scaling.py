"""`ddplab study`, `ddplab report` and `ddplab forecast`: many runs, compared."""

from __future__ import annotations

from pathlib import Path

from ddplab.commands import at_least, output_file, output_folder, split_args
from ddplab.commands.study import run_study
from ddplab.config.reading import parse_duration
from ddplab.engine.run_folder.lock import RunLock
from ddplab.errors import ExitCode, UserError
from ddplab.registry import load_config
from ddplab.runtime.extras import require
from ddplab.study.grid import expand, parse_setups, parse_sweeps
from ddplab.trackers import finish_study


def study(ns) -> int:
    require("report", "ddplab study")  # it ends with a report
    config, common = split_args(ns.args)
    at_least("--nnodes", ns.nnodes)
    budget = parse_duration(ns.budget, "--budget")
    at_least("--repeat", ns.repeat)
    repeat = ns.repeat or load_config(config, common).experiment.repeats
    name = ns.name or (Path(config).stem if config else "study")
    study_dir = Path(ns.output_dir) / name
    points = expand(config, common, parse_setups(ns.nproc, ns.nnodes), parse_sweeps(ns.sweeps), str(study_dir), repeat)
    grid = len({p.point for p in points})
    # One study per folder; each point also locks its own run folder.
    with RunLock(study_dir, what="study folder", names="--output-dir or --name"):
        print(f"study {name}: {grid} points" + (f" x {repeat} repeats" if repeat > 1 else "") + f" -> {study_dir}")
        run_study(study_dir, config, points)
        from ddplab.report.build import make_report  # matplotlib: the report extra, required above

        report_path = make_report([study_dir], study_dir, budget)
        finish_study(study_dir, study_dir)  # the points' parent MLflow run gets the report, then ends
    print(f"report: {report_path}")
    return ExitCode.OK


def report(ns) -> int:
    require("report", "ddplab report")
    from ddplab.report.build import make_report  # matplotlib: the report extra, required above

    budget = parse_duration(ns.budget, "--budget")
    out = ns.output or (ns.dirs[0] if len(ns.dirs) == 1 else "report")
    output_folder("--output", out)
    if ns.output:  # a folder for the report: a new one, or one whose report --force replaces
        if Path(out).is_symlink():
            raise UserError(f"--output {out}: a symbolic link; name a folder for the report")
        if Path(out).is_dir():
            output_file(Path(out) / "report.md", ns.force)
    print(f"report: {make_report(ns.dirs, out, budget)}")
    return ExitCode.OK


def forecast(ns) -> int:
    require("report", "ddplab forecast")
    at_least("--batch-size", ns.batch_size)
    # scipy and matplotlib: the report extra
    from ddplab.forecast import forecast as predict
    from ddplab.forecast.write import write_all

    out = ns.output or (ns.dirs[0] if len(ns.dirs) == 1 else "forecast")
    output_folder("--output", out)
    path = write_all(predict(ns.dirs, ns), Path(out))
    print(f"{path.read_text()}forecast: {path}")
    return ExitCode.OK
