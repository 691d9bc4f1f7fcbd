"""The command line as a user meets it: bad input, a short run, its run folder, generation."""

import csv
import json

import pytest
import torch

from conftest import TINY_GPT, ddplab, main


# Real processes prove the path from the console script to one line on stderr; every bad input, these three
# included, is checked in this process by test_bad_inputs.py.
@pytest.mark.parametrize(
    "args, field",
    [
        (["train", "training.lr=abc"], "training.lr"),
        (["train", "--nproc-per-node", "two"], "--nproc-per-node"),
        (["generate", "/no/such/run"], "/no/such/run"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, field, tmp_path):
    proc = ddplab(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddplab: error:") and field in lines[0], proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "experiments").exists()  # nothing started, nothing written


def test_short_run_writes_a_self_describing_folder(tmp_path, corpus, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # in this process: one process adds nothing (the launcher's path: test_ddp.py)
    code = main(
        "train",
        f"data.path={corpus}",
        *TINY_GPT,
        "training.epochs=2",
        "logging.trackers=[tensorboard]",
        "experiment.name=short",
    )
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    run = tmp_path / "experiments" / "short"
    for name in ("config.yaml", "env.json", "metrics.csv", "metrics.json", "train.log", "sample.txt"):
        assert (run / name).is_file(), name
    assert any((run / "tensorboard").iterdir())
    assert (run / "checkpoints" / "best" / "COMPLETE").is_file()  # the best model, a snapshot of its own
    assert "global batch = 8 per process x 1 accumulation x 1 processes = 8" in out
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert float(rows[1]["val_loss"]) < float(rows[0]["val_loss"])  # it learns
    for col in ("train_loss", "val_perplexity", "epoch_time_s", "samples_per_s", "tokens_per_s", "lr", "peak_mem_mb"):
        assert float(rows[0][col]) > 0, col
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["status"] == "complete" and summary["ddp"]["world_size"] == 1
    assert summary["dataset"]["train"] > 0 and summary["aggregates"]["epochs_completed"] == 2
    env = json.loads((run / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["world_size"] == 1
    snap = torch.load(sorted((run / "checkpoints").glob("step-*/state.pt"))[-1], weights_only=True)
    assert snap["trainer"]["epoch"] == 2

    assert main("generate", str(run), "--prompt", "ROMEO.", "--max-new-tokens", "40") == 0
    out = capfd.readouterr().out
    assert out.startswith("ROMEO.") and len(out.strip()) >= 40

    # The same name again: the finished run is kept, the new one gets a fresh folder.
    assert main("train", f"data.path={corpus}", *TINY_GPT, "training.max_steps=2", "experiment.name=short") == 0
    assert "run folder experiments/short-2" in capfd.readouterr().out
    assert (tmp_path / "experiments" / "short-2" / "metrics.json").is_file()
    assert len(list(csv.DictReader(open(run / "metrics.csv")))) == 2


def test_resume_auto_continues_an_unfinished_run(tmp_path, corpus, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    common = [f"data.path={corpus}", *TINY_GPT, "experiment.name=r", "training.epochs=3"]
    assert main("train", *common, "training.max_steps=10") == 0
    summary = json.loads((tmp_path / "experiments/r/metrics.json").read_text())
    # max_steps ended it: complete, so a new folder would be used; mark it unfinished as a crash would leave it.
    summary["status"] = "running"
    (tmp_path / "experiments/r/metrics.json").write_text(json.dumps(summary))
    capfd.readouterr()
    assert main("train", *common, "training.max_steps=14") == 0
    out = capfd.readouterr().out
    assert "resumed from" in out and "step 10" in out
    final = json.loads((tmp_path / "experiments/r/metrics.json").read_text())
    assert final["aggregates"]["steps"] == 14


def test_overrides_may_follow_options(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    assert main("train", "--max-restarts", "0", "training.lr=abc") == 2
    assert "training.lr" in capfd.readouterr().err
    assert main("train", "--bogus") == 2
    assert capfd.readouterr().err.strip() == "ddplab: error: unrecognized arguments: --bogus (see ddplab --help)"
