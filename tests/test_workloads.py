"""User workloads (file.py:function, ddplab.train) get what built-ins get: 1 and 2 processes,
SLURM, exact resume, verify, predict; bad user code ends in one line, exit 2 (a bug in it: test_failures.py)."""

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, _env, assert_ok, ddplab, main, run_study, verify
from faults import command, ended, forked_ranks, forked_torchrun

EXAMPLES = ROOT / "examples"
FAST = ["logging.trackers=[]", "logging.progress=false", "distributed.timeout=60"]

WORKLOAD = """
import torch
import ddplab
from torch.utils.data import TensorDataset


def data(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 6, generator=g)
    y = x @ torch.linspace(-1, 1, 6) + 0.1 * torch.randn(256, generator=g)
    return ddplab.Data(train=TensorDataset(x[:192], y[:192]), val=TensorDataset(x[192:], y[192:]),
                       task=ddplab.Regression())


def model(cfg, data):
    hidden = cfg.options.get("hidden", 16)
    return torch.nn.Sequential(torch.nn.Linear(6, hidden), torch.nn.Dropout(cfg.options.get("dropout", 0.1)),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
"""


def _workload(folder: Path, text: str = WORKLOAD, name: str = "wl.py") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def _names(path: Path) -> list[str]:
    return [f"model.name={path}:model", f"data.name={path}:data"]


def _rows(run: Path) -> list[dict]:
    return list(csv.DictReader(open(run / "metrics.csv")))


# ---------------------------------------------------------------------------- the README's example


def _readme_example() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Your own model and data", 1)[1]
    code = re.search(r"```python\n(# my_workload.py\n.*?)```", section, re.S).group(1)
    command = re.search(r"```bash\n(ddplab train model.name=my_workload.py:model[^\n]*)\n", section).group(1)
    return code, command


def test_the_readme_workload_trains_with_two_processes_as_written(tmp_path):
    code, command = _readme_example()
    assert len(code.strip().splitlines()) <= 22
    (tmp_path / "my_workload.py").write_text(code)
    args = command.split()[1:]  # what follows `ddplab`
    proc = ddplab(*args, *FAST, cwd=tmp_path)
    assert_ok(proc)
    run = tmp_path / "experiments" / "my_workload.model-my_workload.data"
    rows = _rows(run)
    assert {"val_mae", "val_rmse", "val_r2"} <= set(rows[0]) and float(rows[-1]["val_r2"]) > 0.5
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["ddp"]["world_size"] == 2 and summary["ddp"]["ranks_identical"]
    assert summary["workload"]["model"]["file"] == str(tmp_path / "my_workload.py")
    assert "model.options" not in proc.stderr and (run / "config.yaml").read_text().count("hidden: 64") == 1


# ---------------------------------------------------------------------------- examples


def test_regression_example_reaches_its_r2(tmp_path, monkeypatch, capfd):
    wl = Path(shutil.copy(EXAMPLES / "regression_tabular.py", tmp_path))
    monkeypatch.chdir(tmp_path)  # one process: the CLI's entry in this one
    code = main(
        "train",
        *_names(wl),
        "training.epochs=10",
        "training.batch_size=16",
        "training.warmup_steps=0",
        "experiment.name=reg",
        *FAST,
    )
    assert code == 0, capfd.readouterr().err[-3000:]
    best = max(float(r["val_r2"]) for r in _rows(tmp_path / "experiments" / "reg"))
    assert best >= 0.40, best  # scikit-learn's LinearRegression scores about 0.45 on such a split
    capfd.readouterr()
    code = main(
        "predict",
        "experiments/reg",
        "0.04,0.05,0.06,0.02,-0.04,-0.03,-0.04,0,0.02,-0.02",
        "0,0,0,0,0,0,0,0,0,0",
    )
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert len(lines) == 2 and all(len(line.split("\t")) == 2 for line in lines)
    float(lines[0].split("\t")[0])
    assert f"importing model.name code from {wl}" in err


def test_image_folder_example_with_its_own_loss_on_two_processes(tmp_path, monkeypatch, capfd):
    sys.path.insert(0, str(EXAMPLES))
    try:
        from image_folder_label_smoothing import write_digits_tree
    finally:
        sys.path.remove(str(EXAMPLES))
    write_digits_tree(tmp_path / "tree", per_class=40)
    wl = Path(shutil.copy(EXAMPLES / "image_folder_label_smoothing.py", tmp_path))
    proc = ddplab(
        "train",
        "--nproc-per-node",
        "2",
        *_names(wl),
        f"data.options.root={tmp_path / 'tree'}",
        "training.epochs=4",
        "training.batch_size=16",
        "training.lr=1e-2",
        "training.warmup_steps=0",
        "experiment.name=img",
        *FAST,
        cwd=tmp_path,
    )
    assert_ok(proc)
    rows = _rows(tmp_path / "experiments" / "img")
    assert {"val_accuracy", "val_f1"} <= set(rows[0]) and float(rows[-1]["val_accuracy"]) > 0.6
    # The dataset's own loader and transform read the file; a Task without predict gives its logits.
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    assert main("predict", "experiments/img", "tree/3") == 0
    rows = [line.split("\t") for line in capfd.readouterr().out.strip().splitlines()]
    assert [shown for _, shown in rows] == sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "tree/3").iterdir())
    best = [max(range(10), key=[float(v) for v in logits.split(",")].__getitem__) for logits, _ in rows]
    assert best.count(3) > len(best) / 2
    code, err = main("predict", "experiments/img", "0.1,0.2"), capfd.readouterr().err  # not an image file
    errors = [line for line in err.strip().splitlines() if not line.startswith("ddplab: importing ")]
    assert code == 2 and errors == ["ddplab: error: no such image file: 0.1,0.2"], err


def test_python_api_script_with_a_callback_under_torchrun(tmp_path):
    for name in ("api_callback.py", "regression_tabular.py"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    # torchrun, its workers forked from it (tests/faults.py) where plain torchrun starts a Python for each
    cmd = forked_torchrun(["--standalone", "--nproc-per-node=2"], ["api_callback.py", "training.epochs=2", *FAST])
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert_ok(proc)
    run = tmp_path / "experiments" / "api-callback"
    trace = list(csv.DictReader(open(run / "lr_trace.csv")))
    steps_per_epoch = json.loads((run / "metrics.json").read_text())["ddp"]["steps_per_epoch"]
    # every logging.log_every=5 steps, and at each epoch's end
    assert [int(r["step"]) for r in trace] == sorted(
        set(range(5, 2 * steps_per_epoch + 1, 5)) | {steps_per_epoch, 2 * steps_per_epoch}
    )
    assert "status complete" in proc.stdout
    assert "regression_tabular.py:model" in (run / "config.yaml").read_text()


# ---------------------------------------------------------------------------- guarantees


def test_two_processes_under_slurm_variables(tmp_path):
    wl = _workload(tmp_path)
    env = _env() | {
        "SLURM_NTASKS": "2",  # and each task's SLURM_PROCID and SLURM_LOCALID
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29500 + os.getpid() % 1000),
    }
    # `python -m ddplab train` as srun starts it on each task, forked from one process that imported torch once
    cmd = forked_ranks(
        2, tmp_path, ["-m", "ddplab", "train", *_names(wl), "training.epochs=1", "experiment.name=slurm"]
    )
    assert_ok(subprocess.run([*cmd, *FAST], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300))
    for code, _, err, _ in ended(tmp_path, 2):
        assert code == 0, err[-2000:]
    summary = json.loads((tmp_path / "experiments" / "slurm" / "metrics.json").read_text())
    assert summary["ddp"]["launcher"] == "slurm" and summary["ddp"]["world_size"] == 2


def _weights(run: Path) -> dict:
    from ddplab.engine.snapshots.read import load_snapshot
    from ddplab.engine.snapshots.write import Checkpointer

    ck = Checkpointer(run / "checkpoints", is_main=False)
    return load_snapshot(ck.latest())["model"]


def test_sigkill_and_resume_of_a_user_workload_ends_identical(tmp_path):
    wl = _workload(tmp_path)
    args = [
        "train",
        *_names(wl),
        "training.epochs=2",
        "training.batch_size=16",
        "checkpoint.every=2",
        "logging.log_every=1",
        *FAST,
    ]
    assert_ok(ddplab(args[0], "--nproc-per-node", "2", *args[1:], "experiment.name=ref", cwd=tmp_path))
    # 6 steps per epoch: killed mid-epoch 2
    assert_ok(
        subprocess.run(
            command("kill_rank=1,step=9", [*args, "experiment.name=k"], nproc=2, max_restarts=1),
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    ref, run = tmp_path / "experiments" / "ref", tmp_path / "experiments" / "k"
    mine, theirs = _weights(run), _weights(ref)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    losses = [(s["step"], s["loss"]) for s in json.loads((run / "metrics.json").read_text())["steps"]]
    assert losses == [(s["step"], s["loss"]) for s in json.loads((ref / "metrics.json").read_text())["steps"]]
    assert json.loads((run / "metrics.json").read_text())["aggregates"]["resumes"] == 1


def test_verify_passes_on_a_user_workload(tmp_path):
    wl = _workload(tmp_path)
    proc = verify(
        "--nproc",
        "2",
        *_names(wl),
        "training.max_steps=8",
        "training.batch_size=16",
        "model.options.dropout=0.0",
        cwd=tmp_path,
    )
    assert_ok(proc)
    assert proc.stdout.strip().splitlines()[-1] == "PASS"


def test_study_and_report_sweep_a_user_option(tmp_path):
    wl = _workload(tmp_path)
    proc = run_study(
        *_names(wl),
        "training.epochs=1",
        *FAST,
        "--nproc",
        "1",
        "--set",
        "model.options.hidden=8,16",
        "--name",
        "opts",
        cwd=tmp_path,
    )
    assert_ok(proc)
    report = (tmp_path / "experiments" / "opts" / "report.md").read_text()
    assert "n1-hidden_8" in report and "n1-hidden_16" in report
    for hidden in (8, 16):
        cfg = (tmp_path / "experiments" / "opts" / f"n1-hidden_{hidden}" / "config.yaml").read_text()
        assert f"hidden: {hidden}" in cfg


# ---------------------------------------------------------------------------- bad user code

BAD = {
    "missing_file": ("model.name=nope.py:model", "no such file: nope.py"),
    "missing_module": ("model.name=no_such_package.sub:model", "no module named 'no_such_package.sub'"),
    "missing_function": ("model.name=wl.py:modle", "has no function 'modle'"),
    "not_a_reference": ("data.name=wl.py:", "not a code reference"),
    "import_raises": ("model.name=broken.py:model", "importing"),
    "syntax_error": ("data.name=syntax.py:data", "SyntaxError"),
    "data_not_data": ("data.name=bad.py:returns_dict", "not ddplab.Data"),
    "non_torch_dataset": ("data.name=bad.py:list_dataset", "Data.train is a list; ddplab takes"),
    "no_task": ("data.name=bad.py:no_task", "Data.task is None"),
    "model_not_module": ("model.name=bad.py:not_module", "not a torch.nn.Module"),
    "logits_for_regression": ("model.name=bad.py:ten_logits", "Regression(outputs=1) needs"),
    "not_callable": ("model.name=bad.py:CONSTANT", "not a function"),
}

BAD_CODE = """
import torch
import ddplab
from torch.utils.data import TensorDataset

CONSTANT = 3
_x, _y = torch.randn(16, 6), torch.randn(16)


def returns_dict(cfg):
    return {"train": None}


def list_dataset(cfg):
    return ddplab.Data(train=[(x, y) for x, y in zip(_x, _y)], task=ddplab.Regression())


def no_task(cfg):
    return ddplab.Data(train=TensorDataset(_x, _y))


def raises(cfg):
    open("houses.csv")


def not_module(cfg, data):
    return "a model"


def ten_logits(cfg, data):
    return torch.nn.Linear(6, 10)
"""


def _bad_workloads(folder: Path, case: str) -> list[str]:
    """The workload files of the BAD cases in `folder`, and the names that pick `case`'s."""
    _workload(folder)
    _workload(folder, BAD_CODE, "bad.py")
    _workload(folder, "raise ValueError('boom at import')\n", "broken.py")
    _workload(folder, "def data(cfg)\n    return 1\n", "syntax.py")
    override = BAD[case][0]
    names = {"model.name": "model.name=wl.py:model", "data.name": "data.name=wl.py:data"}
    names[override.split("=")[0]] = override
    return [*names.values(), "training.epochs=1", *FAST]


IN_WORKERS = ("logits_for_regression",)  # found by the workers: run under the launcher


@pytest.mark.parametrize("case", [c for c in BAD if c not in IN_WORKERS])
def test_bad_user_code_ends_in_one_line(tmp_path, case, monkeypatch, capfd):
    args = _bad_workloads(tmp_path, case)
    monkeypatch.chdir(tmp_path)
    assert main("train", *args) == 2
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddplab: error:") and BAD[case][1] in lines[0], err[-1500:]
    assert not (tmp_path / "experiments").exists()  # nothing written


@pytest.mark.parametrize("case", IN_WORKERS)
def test_bad_user_code_found_by_workers_ends_in_one_line(tmp_path, case):
    args = _bad_workloads(tmp_path, case)
    proc = ddplab("train", "--nproc-per-node", "2", *args, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-1500:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and BAD[case][1] in lines[0] and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert not (tmp_path / "experiments").exists()  # nothing written


# ---------------------------------------------------------------------------- tasks


class _One:
    def all_reduce(self, t, op="sum"):
        return t


def test_regression_metrics_match_scikit_learn():
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    from ddplab.tasks import Regression

    g = torch.Generator().manual_seed(0)
    target = torch.randn(100, generator=g)
    output = target + 0.3 * torch.randn(100, generator=g)
    ev = Regression().evaluator(torch.device("cpu"))
    for i in range(0, 100, 32):  # batches, as the evaluation loader gives them
        ev.update(output[i : i + 32, None], target[i : i + 32])
    m = ev.compute(_One())
    target, output = target.double().numpy(), output.double().numpy()  # sums are float64 in ddplab too
    assert m["mae"] == pytest.approx(mean_absolute_error(target, output), rel=1e-9)
    assert m["rmse"] == pytest.approx(mean_squared_error(target, output) ** 0.5, rel=1e-9)
    assert m["r2"] == pytest.approx(r2_score(target, output), rel=1e-9)


def test_a_user_task_scores_with_its_torchmetrics():
    import torchmetrics

    import ddplab

    class Mine(ddplab.Task):
        def loss(self, output, target):
            return torch.nn.functional.cross_entropy(output, target)

        def metrics(self):
            return {"accuracy": torchmetrics.Accuracy("multiclass", num_classes=3)}

    logits = torch.tensor([[3.0, 0, 0], [0, 3.0, 0], [0, 0, 3.0], [3.0, 0, 0]])
    target = torch.tensor([0, 1, 0, 0])
    ev = Mine().evaluator(torch.device("cpu"))
    ev.update(logits[:2], target[:2])
    ev.update(logits[2:], target[2:])
    m = ev.compute(_One())
    assert m["accuracy"] == pytest.approx(0.75) and m["samples"] == 4
    assert m["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, target).item(), rel=1e-6)


def test_options_take_yaml_values_from_the_command_line():
    from ddplab.registry import load_config

    cfg = load_config(
        None,
        [
            "model.options.hidden=64",
            "model.options.sizes=[1, 2]",
            "data.options.csv=h.csv",
            "data.options.split.seed=3",
        ],
    )
    assert cfg.model.options == {"hidden": 64, "sizes": [1, 2]}
    assert cfg.data.options == {"csv": "h.csv", "split": {"seed": 3}}


def test_help_lists_the_builtins_from_the_registry(capsys):
    from ddplab.registry import DATA, MODELS

    assert main("train", "--help") == 0
    out = capsys.readouterr().out
    for name in [*MODELS, *DATA]:
        assert name in out
