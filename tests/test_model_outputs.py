"""Any model output trains: a tensor, a tuple, a dict, an object with .logits; a model that
computes its own loss trains with a Task that returns it, under 2 processes; a user loss that is
not a finite scalar is refused before training, in one line."""

import csv
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import ddplab
from conftest import ROOT, assert_ok
from conftest import ddplab as run_ddplab
from ddplab.cli import main
from ddplab.tasks import Classification, Task, find_logits

FAST = ["logging.trackers=[]", "logging.progress=false", "distributed.timeout=60"]

WORKLOAD = """
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import ddplab


class Output:  # as HF's ModelOutput: the logits as an attribute
    def __init__(self, logits):
        self.logits = logits


class Net(torch.nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def forward(self, x):
        logits = self.body(x)
        return {"tensor": logits, "tuple": (logits, logits.norm()), "dict": {"logits": logits, "extra": x},
                "object": Output(logits), "no_logits": {"scores": logits}}[self.form]


class BadLoss(ddplab.Task):
    def __init__(self, how):
        self.how = how

    def loss(self, output, target):
        per_sample = F.cross_entropy(output, target, reduction="none")
        return per_sample if self.how == "vector" else per_sample.mean() * float("nan")


def data(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(240, 4, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    how = cfg.options.get("loss")
    task = BadLoss(how) if how else ddplab.Classification(2, ["neg", "pos"])
    return ddplab.Data(train=TensorDataset(x[:192], y[:192]), val=TensorDataset(x[192:], y[192:]), task=task)


def model(cfg, data):
    return Net(cfg.options.get("form", "tensor"))
"""


@pytest.fixture
def workload(tmp_path) -> Path:
    path = tmp_path / "outputs.py"
    path.write_text(WORKLOAD)
    return path


def _rows(run: Path) -> list[dict]:
    return list(csv.DictReader(open(run / "metrics.csv")))


@pytest.mark.parametrize("form", ["tensor", "tuple", "dict", "object"])
def test_every_output_form_trains_and_is_scored_by_its_logits(tmp_path, workload, form, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary = ddplab.train(
        None,
        [
            f"model.name={workload}:model",
            f"data.name={workload}:data",
            f"model.options.form={form}",
            "training.epochs=4",
            "training.batch_size=16",
            "training.lr=1e-2",
            "training.warmup_steps=0",
            f"experiment.name={form}",
            *FAST,
        ],
    )
    assert summary["status"] == "complete"
    rows = _rows(tmp_path / "experiments" / form)
    assert float(rows[-1]["val_accuracy"]) > 0.85 and float(rows[-1]["val_loss"]) < float(rows[0]["val_loss"])


@pytest.mark.parametrize(
    "option, phrase",
    [
        ("data.options.loss=nan", "BadLoss.loss(output, target) returned nan on the first two training samples"),
        ("data.options.loss=vector", "BadLoss.loss(output, target) returned a tensor of shape (2,) on a batch of 2"),
        ("model.options.form=no_logits", "returned a dict with keys ['scores']; the task needs logits"),
    ],
    ids=["nan", "vector", "no-logits"],
)
def test_a_loss_that_is_not_a_finite_scalar_is_refused_in_one_line(
    tmp_path, workload, option, phrase, monkeypatch, capfd
):
    monkeypatch.chdir(tmp_path)
    code = main(["train", f"model.name={workload}:model", f"data.name={workload}:data", option, *FAST])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and phrase in err[0], err
    assert not (tmp_path / "experiments").exists()


def test_find_logits_reads_each_form_and_a_user_loss_gets_the_output_as_returned():
    logits = torch.randn(3, 2)
    for output in (logits, (logits, None), [logits], {"logits": logits, "loss": None}):
        assert find_logits(output) is logits

    seen = []

    class Own(Task):
        def loss(self, output, target):
            seen.append(output)
            return output[1]

    output = (logits, torch.tensor(0.5))
    assert Own().loss(output, torch.zeros(3)) == 0.5 and seen[0] is output
    assert Own().predict(output) == [{"output": row} for row in logits.tolist()]
    target = torch.tensor([0, 1, 1])
    assert Classification(2).loss({"logits": logits}, target) == torch.nn.functional.cross_entropy(logits, target)


def test_a_model_that_computes_its_own_loss_trains_under_two_processes(tmp_path):
    wl = Path(shutil.copy(ROOT / "examples" / "own_loss.py", tmp_path))
    proc = run_ddplab(
        "train",
        "--nproc-per-node",
        "2",
        f"model.name={wl}:model",
        f"data.name={wl}:data",
        "data.options.chars=30000",
        "model.options.layers=1",
        "training.epochs=2",
        "training.batch_size=16",
        "training.lr=3e-3",
        "training.warmup_steps=0",
        "experiment.name=own",
        *FAST,
        cwd=tmp_path,
    )
    assert_ok(proc)
    run = tmp_path / "experiments" / "own"
    rows = _rows(run)
    vocab = len(set((Path(ddplab.__file__).parent / "resources" / "shakespeare.txt").read_text()[:30000]))
    # Below the loss of a uniform guess, and falling: it learnt, through the model's own loss.
    assert float(rows[-1]["val_loss"]) < min(math.log(vocab) - 0.5, float(rows[0]["val_loss"]))
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["ddp"]["world_size"] == 2 and summary["ddp"]["ranks_identical"]
