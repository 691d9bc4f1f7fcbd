"""Study and report tables show the task's own metrics: R², MAE, RMSE for regression, a user Task's
torchmetrics by their names, accuracy for classification as before."""

from __future__ import annotations

import json

from ddplab.report.build import make_report
from ddplab.report.runs import find_runs
from ddplab.report.table import build_rows, quality_columns_for


def _run(root, name: str, world: int, val: dict, test: dict, setup: str | None = None) -> None:
    """A finished run's metrics.json, as a study point (`setup`) or a plain run folder."""
    folder = root / name
    folder.mkdir(parents=True)
    epochs = [
        {
            "epoch": e,
            "step": 10 * e,
            "train_loss": 1.0 / e,
            "val_loss": 1.1 / e,
            **{f"val_{k}": v for k, v in val.items()},
            "epoch_time_s": 5.0,
            "elapsed_s": 5.0 * e,
            "samples_per_s": 100.0 * world,
        }
        for e in (1, 2)
    ]
    summary = {
        "status": "complete",
        "config": {"training": {"batch_size": 8}, "data": {"name": "x"}},
        "ddp": {"world_size": world, "per_process": 8, "global": 8 * world, "steps_per_epoch": 10, "lr": 1e-3},
        "epochs": epochs,
        "steps": [],
        "test": {**test, "samples": 40},
        "aggregates": {"steps": 20, "train_time_s": 10.0, "best_val_loss": 0.55},
    }
    (folder / "metrics.json").write_text(json.dumps(summary))
    if setup:
        (folder / "study_point.json").write_text(json.dumps({"point": name, "run": name, "setup": setup}))


REGRESSION = {"loss": 0.25, "mae": 0.4, "rmse": 0.5, "r2": 0.81}


def test_a_regression_study_reports_r2_mae_and_rmse(tmp_path):
    _run(tmp_path, "p1", 1, REGRESSION, {"loss": 0.3, "mae": 0.42, "rmse": 0.55, "r2": 0.8}, setup="1x1")
    _run(tmp_path, "p2", 2, REGRESSION, {"loss": 0.31, "mae": 0.43, "rmse": 0.56, "r2": 0.79}, setup="1x2")
    rows = build_rows(find_runs([tmp_path])[0], None)
    headers = [h for _, h in quality_columns_for(rows)]
    assert headers[-8:] == [
        "best val loss",
        "val R²",
        "val MAE",
        "val RMSE",
        "test loss",
        "test R²",
        "test MAE",
        "test RMSE",
    ]
    assert "val accuracy" not in headers and "test accuracy" not in headers
    text = make_report([tmp_path], tmp_path / "out").read_text()
    quality = text.split("## Quality")[1].split("\n\n")[1]
    assert "| val R² | val MAE | val RMSE |" in quality and "| 0.8100 | 0.4000 | 0.5000 |" in quality
    assert "| **Test R²** | 0.8000 | 0.7900 |" in text and "| **Test RMSE** | 0.5500 | 0.5600 |" in text
    header = (tmp_path / "out" / "report.csv").read_text().splitlines()[0].split(",")
    assert {"val_r2", "val_mae", "val_rmse", "test_r2", "test_mae", "test_rmse"} <= set(header)


def test_a_users_task_metrics_and_classification_accuracy_show_by_name(tmp_path):
    _run(tmp_path, "own", 1, {"loss": 0.5, "auroc": 0.91}, {"loss": 0.52, "auroc": 0.9})
    _run(tmp_path, "cls", 2, {"loss": 0.5, "accuracy": 0.875}, {"loss": 0.52, "accuracy": 0.86})
    rows = build_rows(find_runs([tmp_path])[0], None)
    headers = [h for _, h in quality_columns_for(rows)]
    assert {"val auroc", "test auroc", "val accuracy", "test accuracy"} <= set(headers)
    text = make_report([tmp_path], tmp_path / "out").read_text()
    assert "87.50%" in text and "0.9100" in text


WORKLOAD = '''
import torch
import torchmetrics
from torch.utils.data import TensorDataset

import ddplab


class Scored(ddplab.Task):
    """A user's task: mean squared error, scored by its own torchmetrics."""

    def loss(self, output, target):
        return torch.nn.functional.mse_loss(output, target)

    def metrics(self):
        return {"explained_variance": torchmetrics.ExplainedVariance(), "pearson": torchmetrics.PearsonCorrCoef()}


def _points(task):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 3, generator=g)
    y = x.sum(1) + 0.1 * torch.randn(48, generator=g)
    return ddplab.Data(train=TensorDataset(x[:32], y[:32]), val=TensorDataset(x[32:40], y[32:40]),
                       test=TensorDataset(x[40:], y[40:]), task=task)


def regression(cfg):
    return _points(ddplab.Regression())


def own(cfg):
    return _points(Scored())


def model(cfg, data):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Flatten(0))
'''


def test_real_runs_of_a_regression_and_a_users_task_report_their_own_scores(tmp_path):
    from ddplab.commands.run import train
    from ddplab.registry import load_config

    workload = tmp_path / "scored.py"
    workload.write_text(WORKLOAD)
    for data in ("regression", "own"):
        cfg = load_config(
            None,
            [
                f"data.name={workload}:{data}",
                f"model.name={workload}:model",
                "training.epochs=2",
                "training.batch_size=8",
                "logging.trackers=[]",
                "logging.progress=false",
                f"experiment.output_dir={tmp_path / 'runs'}",
                f"experiment.name={data}",
            ],
        )
        assert train(cfg)["status"] == "complete"
    rows = {r["point"]: r for r in build_rows(find_runs([tmp_path / "runs"])[0], None)}
    for split in ("val", "test"):
        assert all(isinstance(rows["regression"][f"{split}_{k}"], float) for k in ("r2", "mae", "rmse"))
        assert all(isinstance(rows["own"][f"{split}_{k}"], float) for k in ("explained_variance", "pearson"))
    text = make_report([tmp_path / "runs"], tmp_path / "out").read_text()
    quality = text.split("## Quality")[1].split("\n\n")[1]
    header = quality.splitlines()[0]
    for name in ("val R²", "val MAE", "val RMSE", "test R²", "test RMSE", "val explained variance", "test pearson"):
        assert f"| {name} |" in header, header
    assert "accuracy" not in header
