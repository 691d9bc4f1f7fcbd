"""logging.trackers: MLflow (a real local store) and W&B (offline mode) continue one run across a
kill and a resume, a study is one parent MLflow run, and a tracker that fails never stops training."""

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_GPT, _env, assert_ok, ddplab, main, run_study
from faults import command

# Whether they are installed, not imported: importing them costs seconds of every worker's collection.
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("mlflow", "wandb")),
    reason="ddplab's track extra (mlflow, wandb) is not installed",
)

# One process, batch 8 of 96 samples: 12 steps per epoch, 24 in all; a snapshot every 4 steps.
ARGS = [
    *TINY_GPT,
    "data.limit=96",
    "training.epochs=2",
    "checkpoint.every=4",
    "logging.log_every=1",
    "generate.max_new_tokens=0",
    "checkpoint.save_best=false",
]


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B with no network and nothing written outside tmp_path (the tests' subprocesses inherit it)."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
        "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
        "WANDB_DATA_DIR": tmp_path / "wandb-data",
    }.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture
def parent_service(tmp_path):
    """A W&B service of another process in WANDB_SERVICE, as a Python process that used wandb (a notebook, a
    driver script, an in-process ddplab.train) leaves it for the processes it starts; it lives past a killed run."""
    script = "import os, sys, wandb; wandb.setup(); print(os.environ['WANDB_SERVICE'], flush=True); sys.stdin.read()"
    holder = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        token = holder.stdout.readline().strip()
        assert token, "wandb.setup() gave no service"
        yield token
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def _client(root: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{root / 'experiments' / 'mlflow' / 'mlflow.db'}")


def _runs(client) -> list:
    experiment = client.get_experiment_by_name("ddplab")
    return client.search_runs([experiment.experiment_id])


def test_a_killed_run_continues_one_mlflow_run_and_one_wandb_run(
    tmp_path, corpus, wandb_offline, parent_service, monkeypatch, capfd
):
    args = ["train", f"data.path={corpus}", *ARGS, "experiment.name=k", "logging.trackers=[mlflow, wandb]"]
    monkeypatch.setenv("WANDB_SERVICE", parent_service)  # the killed run must not leave its W&B run held there
    killed = subprocess.run(
        command("kill_rank=0,step=10", args), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr[-2000:]  # mid-epoch 1, two steps after the snapshot at step 8
    run = tmp_path / "experiments" / "k"
    first = json.loads((run / "trackers.json").read_text())
    monkeypatch.chdir(tmp_path)  # the same command again, as one process: in this one (a process adds nothing)
    assert main(*args) == 0, capfd.readouterr().err[-2000:]
    assert "resumed from" in (run / "train.log").read_text()
    record = json.loads((run / "trackers.json").read_text())
    assert record["mlflow"]["run_id"] == first["mlflow"]["run_id"] and record["wandb"]["id"] == first["wandb"]["id"]

    client = _client(tmp_path)
    (only,) = _runs(client)  # one MLflow run for the whole ddplab run
    run_id = only.info.run_id
    assert run_id == record["mlflow"]["run_id"] and only.info.status == "FINISHED"
    losses = [(r["step"], r["loss"]) for r in json.loads((run / "metrics.json").read_text())["steps"]]
    history = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, 25))  # steps 9 and 10, replayed, are there once
    assert [m.value for m in history] == pytest.approx([loss for _, loss in losses])
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    for column in ("val_loss", "train_loss", "epoch", "samples_per_s"):
        logged = client.get_metric_history(run_id, column)
        assert [m.step for m in logged] == [int(r["step"]) for r in rows], column
        assert [m.value for m in logged] == pytest.approx([float(r[column]) for r in rows]), column
    assert only.data.params["training.batch_size"] == "8" and only.data.params["logging.log_every"] == "1"
    assert only.data.tags["env.torch"] and only.data.tags["env.world_size"] == "1"
    assert {a.path for a in client.list_artifacts(run_id)} == {"config.yaml", "metrics.csv"}

    offline = sorted((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and {p.name.rsplit("-", 1)[1] for p in offline} == {record["wandb"]["id"]}
    warnings = [line for line in (run / "train.log").read_text().splitlines() if "tracker" in line]
    assert (record["wandb"]["train"], record["wandb"]["epoch"]) == (24, 24), warnings


def test_a_study_is_one_parent_mlflow_run_with_a_child_per_point(tmp_path, corpus, wandb_offline):
    proc = run_study(
        f"data.path={corpus}",
        *TINY_GPT,
        "data.limit=64",
        "training.epochs=1",
        "generate.max_new_tokens=0",
        "logging.trackers=[mlflow]",
        "--nproc",
        "1,2",
        "--set",
        "training.lr=3e-3",  # one value: the child's tag is still checked against its point's
        "--name",
        "s",
        cwd=tmp_path,
    )
    assert_ok(proc)
    client = _client(tmp_path)
    runs = {r.info.run_name: r for r in _runs(client)}
    parent = runs.pop("s")
    assert parent.info.status == "FINISHED"
    assert (
        parent.info.run_id
        == json.loads((tmp_path / "experiments" / "s" / "trackers.json").read_text())["mlflow"]["run_id"]
    )
    assert {"report/report.md", "report/report.csv"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id, "report")
    }
    # one child per point, two-process points included: rank 1 never touched the tracker
    points = {
        p.parent.name: json.loads(p.read_text()) for p in (tmp_path / "experiments" / "s").glob("*/study_point.json")
    }
    assert len(points) == 2 and sorted(runs) == sorted(points)
    assert sorted(p["setup"] for p in points.values()) == ["1x1", "1x2"]
    for name, child in runs.items():
        tags, point = child.data.tags, points[name]
        assert tags["mlflow.parentRunId"] == parent.info.run_id and child.info.status == "FINISHED"
        assert (tags["setup"], tags["repeat"], tags["training.lr"]) == (
            point["setup"],
            "1",
            point["swept"]["training.lr"],
        )


def test_a_tracking_server_that_is_down_warns_once_and_training_completes(tmp_path, corpus, wandb_offline):
    proc = ddplab(
        "train",
        f"data.path={corpus}",
        *ARGS,
        "training.max_steps=6",
        "experiment.name=down",
        "logging.trackers=[mlflow]",
        "logging.mlflow_uri=http://127.0.0.1:9",
        cwd=tmp_path,
    )
    assert_ok(proc)
    run = tmp_path / "experiments" / "down"
    assert (proc.stdout + proc.stderr).count("WARNING: tracker mlflow") == 1
    assert json.loads((run / "metrics.json").read_text())["status"] == "complete"
    assert len(list(csv.DictReader(open(run / "metrics.csv")))) == 1 and not (run / "trackers.json").exists()


def test_an_unknown_tracker_or_a_missing_extra_exits_2_before_anything_starts(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    assert main("train", "logging.trackers=[tensorboard, neptune]") == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddplab: error:")
    assert "logging.trackers" in err and "tensorboard, mlflow, wandb" in err
    assert not (tmp_path / "experiments").exists()

    import importlib.util

    from ddplab.errors import UserError
    from ddplab.registry import load_config

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    line = r"logging.trackers=wandb needs wandb: pip install 'mlflow\S*' 'wandb\S*' \(ddplab's track extra\)$"
    with pytest.raises(UserError, match=line):
        load_config(None, ["logging.trackers=wandb"])
    assert load_config(None, ["logging.trackers=[]"]).logging.trackers == []
