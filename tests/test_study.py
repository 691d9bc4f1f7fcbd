"""`ddplab study`: the grid, a real sweep with its report, resuming, and two agents on loopback."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import warm

from conftest import TINY_GPT, _env, assert_ok, main, run_study
from ddplab.commands.study import slurm_command
from ddplab.errors import UserError
from ddplab.study.grid import Setup, expand, parse_setups, parse_sweeps

FAST = [*TINY_GPT, "generate.max_new_tokens=0", "checkpoint.save_best=false"]


def test_setups_sweeps_and_point_names(tmp_path):
    assert parse_setups("1,2,4") == [Setup(1, 1), Setup(1, 2), Setup(1, 4)]
    assert parse_setups("1x1, 1x4,2x2") == [Setup(1, 1), Setup(1, 4), Setup(2, 2)]
    assert parse_setups("2", nnodes=2) == [Setup(2, 2)]
    assert parse_sweeps(["training.batch_size=8,32", "training.lr=1e-3"]) == {
        "training.batch_size": ["8", "32"],
        "training.lr": ["1e-3"],
    }
    points = expand(
        None,
        ["training.max_steps=3"],
        parse_setups("1,2x2"),
        parse_sweeps(["training.batch_size=8,32"]),
        str(tmp_path / "s"),
    )
    assert [p.name for p in points] == [
        "n1-batch_size_8",
        "n1-batch_size_32",
        "n2x2-batch_size_8",
        "n2x2-batch_size_32",
    ]
    assert points[3].setup.processes == 4
    assert (
        "training.batch_size=32" in points[3].overrides and "experiment.name=n2x2-batch_size_32" in points[3].overrides
    )
    twice = expand(None, [], parse_setups("1x2,2x1"), {}, str(tmp_path / "s"), repeat=2)
    assert [(p.name, p.point, p.repeat) for p in twice] == [
        ("n2", "n2", 1),
        ("n2x1", "n2x1", 1),
        ("n2-r2", "n2", 2),
        ("n2x1-r2", "n2x1", 2),
    ]
    assert "experiment.name=n2x1-r2" in twice[3].overrides and twice[3].setup == Setup(2, 1)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: parse_setups("1,two"), ["--nproc", "two"]),
        (lambda: parse_setups("0"), ["--nproc", "0"]),
        (lambda: parse_sweeps(["training.batch_size"]), ["--set", "key=v1,v2"]),
        (lambda: parse_sweeps(["training.batch_size=8,"]), ["--set", "training.batch_size"]),
        (lambda: expand(None, [], [Setup(1, 1)], {"training.batch_size": ["8", "-1"]}, "s"), ["training.batch_size"]),
        (lambda: expand(None, [], [Setup(1, 1)], {"training.nope": ["1"]}, "s"), ["training.nope"]),
        (lambda: expand(None, ["experiment.name=x"], [Setup(1, 1)], {}, "s"), ["--name"]),
    ],
)
def test_bad_grids_are_one_line_errors(call, words):
    with pytest.raises(UserError) as err:
        call()
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), err.value


def test_bad_study_input_exits_2_before_anything_starts(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    assert main("study", "--nproc", "1,2", "--set", "training.batch_size=8,zero") == 2
    err = capfd.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("ddplab: error:"), err
    assert "training.batch_size" in err and not (tmp_path / "experiments").exists()


def test_slurm_points_run_one_agent_per_node_through_srun():
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_JOB_NUM_NODES": "2"}
    cmd = slurm_command(Setup(2, 4), ["train", "x.yaml"], "s-n2x4", 0, env)
    assert cmd[:4] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1"]
    assert "--nproc-per-node=4" in cmd and "--nnodes=2" in cmd and "--rdzv-backend=c10d" in cmd
    assert any(a.startswith("--rdzv-endpoint=gpu03:") for a in cmd)
    assert cmd[-2:] == ["train", "x.yaml"]


def _png_ok(path):
    import matplotlib.image

    image = matplotlib.image.imread(path)
    return image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_study_sweeps_processes_and_batch_then_reports(tmp_path, corpus):
    args = [
        "study",
        f"data.path={corpus}",
        *FAST,
        "data.limit=256",
        "training.epochs=1",
        "--nproc",
        "1,2",
        "--set",
        "training.batch_size=8,32",
        "--name",
        "sweep",
    ]
    proc = run_study(*args[1:], cwd=tmp_path)
    assert_ok(proc)
    study = tmp_path / "experiments" / "sweep"
    names = ["n1-batch_size_8", "n1-batch_size_32", "n2-batch_size_8", "n2-batch_size_32"]
    for name in names:
        summary = json.loads((study / name / "metrics.json").read_text())
        assert summary["status"] == "complete"
        assert summary["ddp"]["world_size"] == int(name[1]) and summary["ddp"]["per_process"] == int(
            name.split("_")[-1]
        )
    report = (study / "report.md").read_text()
    timing, quality = [line for line in report.splitlines() if line.startswith("| point")]
    for column in (
        "processes",
        "batch / process",
        "global batch",
        "lr",
        "steps / epoch",
        "mean epoch time (s)",
        "samples/s",
        "speedup",
        "efficiency",
        "comm ms/step",
        "epochs @ budget",
        "repeats",
    ):
        assert f"| {column} |" in timing, column
    for column in ("best val loss", "val accuracy"):  # a text corpus has no test split
        assert f"| {column} |" in quality, column
    import csv

    rows = {r["point"]: r for r in csv.DictReader(open(study / "report.csv"))}
    assert set(rows) == set(names)
    for row in rows.values():
        procs = int(row["processes"])
        assert int(row["global_batch"]) == procs * int(row["batch_per_process"])
        base = rows[f"n1-batch_size_{row['batch_per_process']}"]
        speedup = float(row["samples_per_s"]) / float(base["samples_per_s"])
        assert float(row["speedup"]) == pytest.approx(speedup)
        assert float(row["efficiency"]) == pytest.approx(speedup / procs)
        assert float(row["mean_epoch_time_s"]) > 0 and float(row["best_val_loss"]) > 0
        assert (float(row["comm_ms_per_step"]) > 0) == (procs > 1)
    assert rows["n1-batch_size_8"]["steps_per_epoch"] == "32" and rows["n2-batch_size_32"]["steps_per_epoch"] == "4"
    for png in (
        "epoch_time",
        "scaling",
        "vs_batch_size",
        "val_epochs",
        "loss_epochs",
        "loss_time",
        "accuracy_time",
        "comm",
    ):
        assert f"({png}.png)" in report and _png_ok(study / f"{png}.png"), png

    # The same command again: every point is complete, nothing is trained twice.
    before = {n: (study / n / "metrics.json").stat().st_mtime_ns for n in names}
    again = run_study(*args[1:], cwd=tmp_path)
    assert_ok(again)
    assert again.stdout.count("complete, skipped") == 4
    assert before == {n: (study / n / "metrics.json").stat().st_mtime_ns for n in names}


def test_interrupted_study_does_not_rerun_finished_points(tmp_path, corpus):
    args = [
        sys.executable,
        "-m",
        "ddplab",
        "study",
        f"data.path={corpus}",
        *FAST,
        "--nproc",
        "1",
        "--set",
        "training.max_steps=4,60",  # the second point lasts long enough to be interrupted on a loaded machine
        "--name",
        "cut",
    ]
    study = tmp_path / "experiments" / "cut"
    first, second = study / "n1-max_steps_4", study / "n1-max_steps_60"
    proc = subprocess.Popen(
        warm.command(args),  # Ctrl-C to its group reaches the stub, which passes it on to the study
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.time() + 240
    while not (second / "train.log").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.stdout.read()
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C while the second point runs
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "study interrupted during point n1-max_steps_60" in out, out
    done = json.loads((first / "metrics.json").read_text())
    assert done["status"] == "complete"
    assert (
        not (second / "metrics.json").exists()
        or json.loads((second / "metrics.json").read_text())["status"] != "complete"
    )
    stamp = (first / "metrics.json").stat().st_mtime_ns

    again = subprocess.run(warm.command(args), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert_ok(again)
    assert "[1/2] n1-max_steps_4 (1 processes): complete, skipped" in again.stdout
    assert "[2/2] n1-max_steps_60 (1 processes): done" in again.stdout
    assert (first / "metrics.json").stat().st_mtime_ns == stamp
    assert json.loads((second / "metrics.json").read_text())["status"] == "complete"


def test_two_launcher_agents_on_loopback_train_as_two_nodes(tmp_path, corpus):
    proc = run_study(
        f"data.path={corpus}",
        *FAST,
        "training.max_steps=6",
        "logging.log_every=2",
        "--nproc",
        "1",
        "--nnodes",
        "2",
        "--name",
        "nodes",
        cwd=tmp_path,
    )
    assert_ok(proc)
    folder = tmp_path / "experiments" / "nodes" / "n2x1"
    summary = json.loads((folder / "metrics.json").read_text())
    assert summary["ddp"]["world_size"] == 2 and summary["ddp"]["launcher"] == "torchrun"
    assert summary["ddp"]["global"] == 16 and summary["ddp"]["ranks_identical"] is True
    assert summary["aggregates"]["steps"] == 6 and len(summary["steps"]) == 3
    assert "--rdzv-backend=c10d" in (folder / "launcher.log").read_text()
    assert json.loads((folder / "study_point.json").read_text())["nodes"] == 2


def test_a_failing_point_stops_the_study_and_keeps_the_finished_ones(tmp_path, corpus):
    empty = tmp_path / "empty"
    empty.mkdir()  # passes the up-front check (it exists) but holds no text: the run itself fails
    proc = run_study(
        *FAST,
        "training.max_steps=2",
        "--nproc",
        "1",
        "--set",
        f"data.path={corpus},{empty}",
        "--name",
        "broken",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("ddplab: failed: study stopped: point n1-path_") and "launcher.log" in message
    assert "holds no .txt files" in proc.stderr  # the failing run's own words, from its log
    study = tmp_path / "experiments" / "broken"
    finished = [json.loads(m.read_text()) for m in study.glob("*/metrics.json")]
    assert [m["status"] for m in finished] == ["complete"]  # the good point is kept
    assert finished[0]["config"]["data"]["path"] == str(corpus)
    assert not (study / "report.md").exists()


def test_repeats_run_as_their_own_folders_and_a_larger_repeat_keeps_the_done_ones(tmp_path, corpus):
    args = ["study", f"data.path={corpus}", *FAST, "training.max_steps=2", "--nproc", "1", "--name", "rep"]
    first = run_study(*args[1:], "--repeat", "2", cwd=tmp_path)
    assert_ok(first)
    assert "1 points x 2 repeats" in first.stdout
    study = tmp_path / "experiments" / "rep"
    stamps = {n: (study / n / "metrics.json").stat().st_mtime_ns for n in ("n1", "n1-r2")}
    assert json.loads((study / "n1-r2" / "study_point.json").read_text())["repeat"] == 2
    again = run_study(*args[1:], "experiment.repeats=3", cwd=tmp_path)  # the config default, as a user sets it
    assert_ok(again)
    assert again.stdout.count("complete, skipped") == 2 and "[3/3] n1-r3 (1 processes): done" in again.stdout
    assert stamps == {n: (study / n / "metrics.json").stat().st_mtime_ns for n in ("n1", "n1-r2")}
    import csv

    rows = list(csv.DictReader(open(study / "report.csv")))
    assert len(rows) == 1 and rows[0]["repeats"] == "3" and rows[0]["runs"] == "n1 n1-r2 n1-r3"
    # two steps: one part-epoch row per run, whose samples/s is the run's
    rates = [
        json.loads((study / n / "metrics.json").read_text())["epochs"][-1]["samples_per_s"]
        for n in ("n1", "n1-r2", "n1-r3")
    ]
    assert float(rows[0]["samples_per_s_min"]) == pytest.approx(min(rates))
    assert float(rows[0]["samples_per_s_max"]) == pytest.approx(max(rates))
