"""`ddplab report`: arithmetic of the table from run folders written by hand, and bad input."""

import csv
import json

import pytest

from conftest import ddplab
from ddplab.errors import UserError
from ddplab.report.build import make_report
from ddplab.report.runs import find_runs
from ddplab.report.table import build_rows, epochs_within


def _run_folder(root, name, world, rate, *, batch=8, lr=1e-3, status="complete", epoch_time=10.0, test=None):
    folder = root / name
    folder.mkdir(parents=True)
    epochs = [{"epoch": e, "step": 10 * e, "train_loss": 2.0 / e, "val_loss": 2.1 / e, "val_accuracy": 0.3 * e,
               "epoch_time_s": epoch_time, "elapsed_s": epoch_time * e, "samples_per_s": rate,
               "comm_time_s": 0.5 if world > 1 else 0.0, "compute_time_s": epoch_time - (0.5 if world > 1 else 0.0)}
              for e in (1, 2, 3)]
    steps = [{"step": s, "loss": 2.0, "lr": lr, "elapsed_s": epoch_time * s / 10} for s in range(5, 31, 5)]
    summary = {"status": status, "config": {"training": {"batch_size": batch, "lr": lr}, "experiment": {"name": name}},
               "ddp": {"world_size": world, "per_process": batch, "global": batch * world, "steps_per_epoch": 10,
                       "lr": lr, "grad_accum_steps": 1},
               "epochs": epochs, "steps": steps, "test": test or {},
               "aggregates": {"steps": 30, "train_time_s": 3 * epoch_time, "best_val_loss": 0.7}}
    (folder / "metrics.json").write_text(json.dumps(summary))
    return folder


def test_speedup_and_efficiency_against_the_one_process_run_of_the_same_experiment(tmp_path):
    _run_folder(tmp_path, "a1", 1, 100.0)
    _run_folder(tmp_path, "a4", 4, 300.0, epoch_time=4.0, test={"loss": 0.5, "accuracy": 0.875})
    _run_folder(tmp_path, "b1", 1, 400.0, batch=32)
    _run_folder(tmp_path, "b2", 2, 600.0, batch=32)
    _run_folder(tmp_path, "c2", 2, 150.0, lr=5e-3)  # no 1-process run with this lr: no speedup
    _run_folder(tmp_path, "late", 2, 1.0, status="running")
    runs, unfinished = find_runs([tmp_path])
    assert [u.name for u in unfinished] == ["late"]
    rows = {r["point"]: r for r in build_rows(runs, budget_s=12.0)}
    assert rows["a4"]["speedup"] == pytest.approx(3.0) and rows["a4"]["efficiency"] == pytest.approx(0.75)
    assert rows["b2"]["speedup"] == pytest.approx(1.5) and rows["b2"]["efficiency"] == pytest.approx(0.75)
    assert rows["a1"]["speedup"] == pytest.approx(1.0) and rows["b2"]["baseline"] == "b1"
    assert rows["c2"]["speedup"] is None and rows["c2"]["efficiency"] is None
    assert rows["a4"]["global_batch"] == 32 and rows["a4"]["mean_epoch_time_s"] == pytest.approx(4.0)
    assert rows["a4"]["comm_ms_per_step"] == pytest.approx(1000 * 1.5 / 30)
    # 12 s of training: a1 (10 s epochs) reached step 10 at 10 s; a4 (4 s epochs) step 30 at 12 s.
    assert rows["a1"]["epochs_at_budget"] == pytest.approx(1.0) and rows["a4"]["epochs_at_budget"] == pytest.approx(3.0)


def test_epochs_within_budget_uses_the_step_log(tmp_path):
    runs, _ = find_runs([_run_folder(tmp_path, "r", 1, 100.0)])
    assert epochs_within(runs[0], 15.0) == pytest.approx(1.5)  # step 15 logged at 15 s
    assert epochs_within(runs[0], 0.1) == 0


def test_report_files(tmp_path):
    _run_folder(tmp_path / "runs", "a1", 1, 100.0)
    _run_folder(tmp_path / "runs", "a2", 2, 180.0, test={"loss": 0.5, "accuracy": 0.9})
    md = make_report([tmp_path / "runs"], tmp_path / "out", budget_s=25.0)
    text = md.read_text()
    assert "| a2 |" in text and "| 1.80 | 0.90 |" in text and "90.00%" in text
    assert "within 25.0 s" in text
    rows = list(csv.DictReader(open(tmp_path / "out" / "report.csv")))
    assert [r["point"] for r in rows] == ["a1", "a2"] and float(rows[1]["efficiency"]) == pytest.approx(0.9)
    for png in ("epoch_time", "scaling", "loss_epochs", "loss_time", "accuracy_time", "comm"):
        assert (tmp_path / "out" / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_finished_runs_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no finished run folders"):
        find_runs([tmp_path])
    proc = ddplab("report", str(tmp_path / "missing"), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "missing" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = ddplab("report", str(tmp_path), "--budget", "soon", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "--budget" in proc.stderr
