"""What users look for is where they look: the task's own metrics on the epoch line (console and train.log), the
test split's results at the end, and the class names given to a task in the confusion matrix and per-class
report."""

from __future__ import annotations

import json

import ddplab

WORKLOAD = """
import torch
import torchmetrics
import ddplab
from torch.utils.data import TensorDataset


class Scored(ddplab.Task):
    def loss(self, output, target):
        return torch.nn.functional.cross_entropy(output, target)

    def metrics(self):
        return {"token_acc": torchmetrics.classification.MulticlassAccuracy(2, average="micro")}


def data(cfg):
    x = torch.randn(96, 4, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    task = Scored() if cfg.options.get("own") else ddplab.Classification(2, ["milton", "python_docs"])
    sets = [TensorDataset(x[i : i + 32], y[i : i + 32]) for i in (0, 32, 64)]
    return ddplab.Data(train=sets[0], val=sets[1], test=sets[2], task=task)


def model(cfg, data):
    return torch.nn.Linear(4, 2)
"""

FAST = ["logging.trackers=[]", "logging.progress=false", "training.epochs=1", "training.batch_size=8"]


def _train(tmp_path, monkeypatch, name: str, *extra: str) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.py").write_text(WORKLOAD)
    ddplab.train(None, ["model.name=w.py:model", "data.name=w.py:data", f"experiment.name={name}", *FAST, *extra])
    return (tmp_path / "experiments" / name / "train.log").read_text()


def test_the_tasks_own_metric_is_on_the_epoch_line_and_the_test_results_at_the_end(tmp_path, monkeypatch, capfd):
    log = _train(tmp_path, monkeypatch, "own", "data.options.own=true")
    epoch = next(line for line in log.splitlines() if "epoch 1: " in line)
    assert "val_token_acc " in epoch, log
    test = next(line for line in log.splitlines() if "test (" in line)
    assert "test (32 samples, best model): loss " in test and "token_acc " in test, test
    assert "val_token_acc " in capfd.readouterr().out  # the console shows what train.log holds


def test_class_names_given_to_the_task_name_the_confusion_matrix_and_per_class_report(tmp_path, monkeypatch):
    log = _train(tmp_path, monkeypatch, "names")
    run = tmp_path / "experiments" / "names"
    assert (run / "confusion_matrix_val.csv").read_text().splitlines()[0] == "true \\ predicted,milton,python_docs"
    classes = json.loads((run / "metrics.json").read_text())["classes"]
    assert classes["test"]["classes"] == ["milton", "python_docs"] and set(classes["val"]["per_class"]) == {
        "milton",
        "python_docs",
    }
    assert "test (32 samples, best model): loss " in log
