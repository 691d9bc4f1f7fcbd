"""A training loop users can steer: a stop asked for by a callback, early stopping whose count survives a
SIGKILL, the hooks' timing as a contract, any optimizer or schedule resumed bit for bit (ddp, fsdp), a
verify that takes dropout out and names BatchNorm, and users' models as they are (unused parameters,
SyncBatchNorm)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

import ddplab
from conftest import _env, assert_ok, verify
from conftest import ddplab as ddplab_cli
from ddplab.cli import main
from ddplab.commands.run import train
from ddplab.config.reading import read_config
from ddplab.engine.snapshots.read import load_snapshot
from ddplab.engine.snapshots.write import Checkpointer
from ddplab.registry import load_config
from faults import command, forked_torchrun

# One bias b, trained towards 1 with plain SGD, scored against targets around 0.3: b after epoch k is
# 1 - 0.9^k (0.1, 0.19, 0.271, 0.344, ...), so the validation loss falls to epoch 3 and rises after it.
DRIFT = '''
import torch
from torch.utils.data import TensorDataset

import ddplab


def data(cfg):
    n = cfg.options.get("samples", 4)
    x = torch.ones(n, 4)
    val = torch.tensor([0.2, 0.4] * 2)
    return ddplab.Data(train=TensorDataset(x, torch.ones(n)), val=TensorDataset(torch.ones(4, 4), val),
                       test=TensorDataset(torch.ones(4, 4), val), task=ddplab.Regression())


class Bias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.b = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.b.expand(len(x))


def model(cfg, data):
    return Bias()


class TwoLayers(torch.nn.Module):
    def __init__(self, normed=False):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8) if normed else torch.nn.Dropout(0.2)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.body(x)))).squeeze(-1)


class Spare(TwoLayers):
    def __init__(self):
        super().__init__()
        self.spare = torch.nn.Linear(8, 8)  # never used in forward


def spare(cfg, data):
    return Spare()


def compiled(cfg, data):
    return torch.compile(TwoLayers())


def two_layers(cfg, data):
    return TwoLayers()


def normed(cfg, data):
    return TwoLayers(normed=True)


def noisy(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x.sum(1) + 0.1 * torch.randn(64, generator=g)
    return ddplab.Data(train=TensorDataset(x[:48], y[:48]), val=TensorDataset(x[48:], y[48:]),
                       task=ddplab.Regression())


def optimizer(cfg, model):
    """Two groups: the body at a tenth of the head's rate, without weight decay."""
    lr = cfg.config.training.lr
    return torch.optim.AdamW([{"params": model.body.parameters(), "lr": lr * 0.1, "weight_decay": 0.0},
                              {"params": model.head.parameters(), "lr": lr}], lr=lr)


def schedule(cfg, optimizer, total_steps):
    return torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=total_steps, eta_min=cfg.options.get("floor", 0.0)
    )
'''

SGD = [
    "training.optimizer=sgd",
    "training.lr=0.05",
    "training.momentum=0",
    "training.weight_decay=0",
    "training.warmup_steps=0",
    "training.schedule=constant",
    "training.clip_grad_norm=null",
    "training.batch_size=4",
    "logging.trackers=[]",
    "logging.progress=false",
    "logging.log_every=1",
]


@pytest.fixture
def drift(tmp_path: Path) -> Path:
    path = tmp_path / "drift.py"
    path.write_text(DRIFT)
    return path


def _workload(drift: Path, model: str = "model", data: str = "data") -> list[str]:
    return [f"model.name={drift}:{model}", f"data.name={drift}:{data}"]


def _summary(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def _early(drift: Path, tmp_path: Path, name: str) -> list[str]:
    return [
        *_workload(drift),
        *SGD,
        "training.epochs=20",
        "training.early_stopping.monitor=val_loss",
        "training.early_stopping.patience=3",
        f"experiment.output_dir={tmp_path}",
        f"experiment.name={name}",
    ]


# ---------------------------------------------------------------------------- early stopping and a stop's persistence


def test_early_stopping_stops_at_the_best_epoch_plus_patience_and_a_rerun_trains_nothing(tmp_path, drift, capfd):
    run = tmp_path / "early"
    summary = train(load_config(None, _early(drift, tmp_path, "early")))
    assert summary["status"] == "complete" and summary["stop_reason"] == "early_stopping"
    val = [row["val_loss"] for row in summary["epochs"]]
    assert len(val) == 6 and min(val) == val[2]  # best at epoch 3, stopped at 3 + patience
    assert summary["aggregates"]["best_epoch"] == 3 and summary["steps"][-1]["step"] == 6
    # test and export use the best model: epoch 3's weights give epoch 3's loss on the same samples,
    # and epoch 3's bias, 1 - 0.9^3
    assert summary["test"]["loss"] == pytest.approx(val[2], rel=1e-6)
    from safetensors.torch import load_file

    assert main(["export", str(run)]) == 0
    assert load_file(run / "model.safetensors")["b"].item() == pytest.approx(1 - 0.9**3, rel=1e-5)
    log = (run / "train.log").read_text()
    assert f"early stopping: epoch 6 val_loss {val[5]:.6g} is not < {val[2]:.6g}" in log and "3/3 epochs" in log
    assert "done: early_stopping;" in log
    capfd.readouterr()
    assert main(["status", str(run)]) == 0 and capfd.readouterr().out == "complete\n"

    # A job killed after its last snapshot, before it was recorded complete: the same command ends it
    # without a step more.
    marked = _summary(run)
    (run / "metrics.json").write_text(json.dumps({**marked, "status": "running"}))
    again = train(load_config(None, _early(drift, tmp_path, "early")))
    assert again["status"] == "complete" and again["stop_reason"] == "early_stopping"
    assert again["steps"][-1]["step"] == 6 and again["aggregates"]["resumes"] == 1
    assert "nothing left to train" in (run / "train.log").read_text()
    assert not (tmp_path / "early-2").exists()


def test_a_sigkill_half_way_through_the_patience_then_a_resume_stops_at_the_same_epoch(tmp_path, drift):
    args = _early(drift, tmp_path, "killed")
    # Epoch 4 was the first without improvement (its snapshot counts 1 of 3); killed during epoch 5.
    killed = subprocess.run(
        command("kill_rank=0,step=5", ["train", *args]),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = train(load_config(None, args))
    assert resumed["aggregates"]["resumes"] == 1 and resumed["stop_reason"] == "early_stopping"
    assert resumed["aggregates"]["epochs_completed"] == 6 and resumed["steps"][-1]["step"] == 6


def test_early_stopping_refuses_settings_that_cannot_work():
    for bad in ({"patience": 0}, {"mode": "lowest"}, {"min_delta": -1.0}):
        with pytest.raises(ddplab.UserError):
            ddplab.EarlyStopping(**bad)


# ---------------------------------------------------------------------------- request_stop on one rank

ASK = """
import sys

import ddplab


class Ask(ddplab.Callback):
    def on_step_end(self, view):
        if view.rank == 1 and view.step == 3:
            view.request_stop("enough")


if __name__ == "__main__":
    ddplab.train(None, sys.argv[1:], callbacks=[Ask()])
"""


def test_a_stop_asked_on_one_rank_is_agreed_at_the_next_log_interval_and_ends_complete(tmp_path, drift, capfd):
    script = tmp_path / "ask.py"
    script.write_text(ASK)
    args = [
        *_workload(drift),
        *SGD,
        "data.options.samples=32",
        "training.batch_size=2",
        "training.epochs=3",
        "logging.log_every=2",
        "experiment.name=ask",
        "distributed.timeout=60",
    ]
    proc = subprocess.run(  # torchrun, its workers forked from it (tests/faults.py): each imports nothing again
        forked_torchrun(["--standalone", "--nproc-per-node=2"], [str(script), *args]),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_ok(proc)
    run = tmp_path / "experiments" / "ask"
    summary = _summary(run)
    assert summary["status"] == "complete" and summary["stop_reason"] == "enough"
    assert summary["aggregates"]["steps"] == 4  # asked after step 3, agreed at the log interval of step 4
    assert summary["epochs"][-1].get("partial") and summary["epochs"][-1]["val_loss"] is not None
    log = (run / "train.log").read_text()
    assert "stop requested (enough, by a callback on rank 1) after step 4" in log
    assert "done: enough;" in log
    capfd.readouterr()
    assert main(["status", str(run)]) == 0 and capfd.readouterr().out == "complete\n"
    latest = Checkpointer(run / "checkpoints", is_main=False).latest()
    assert load_snapshot(latest)["trainer"]["stop_reason"] == "enough"


# ---------------------------------------------------------------------------- the hooks' timing


class Timeline(ddplab.Callback):
    """What the view holds at every hook: (hook, epoch, step, rows in history, best epoch)."""

    def __init__(self):
        self.seen = []

    def _note(self, hook, view, extra=None):
        best, best_epoch = view.best
        self.seen.append((hook, view.epoch, view.step, len(view.history), best_epoch, extra))
        if hook in ("on_eval_end", "on_epoch_end") and extra in ("val", False):
            assert best == min(r for r in self.vals)  # this evaluation is in view.best already

    def on_train_start(self, view):
        self.vals = []
        self._note("on_train_start", view)

    def on_epoch_start(self, view):
        self._note("on_epoch_start", view)

    def on_step_end(self, view):
        self._note("on_step_end", view)

    def on_log(self, view, values):
        self._note("on_log", view)

    def on_eval_end(self, view, split, metrics):
        if split == "val":
            self.vals.append(metrics["loss"])
        self._note("on_eval_end", view, split)

    def on_epoch_end(self, view, row):
        assert row["epoch"] == view.epoch and view.history[-1]["epoch"] == row["epoch"]
        self._note("on_epoch_end", view, bool(row.get("partial")))

    def on_snapshot(self, view, path):
        self._note("on_snapshot", view)

    def on_train_end(self, view, summary):
        self._note("on_train_end", view)


def test_what_each_hook_sees_is_the_documented_contract(tmp_path, drift):
    timeline = Timeline()
    cfg = load_config(
        None,
        [
            *_workload(drift),
            *SGD,
            "data.options.samples=8",
            "training.epochs=2",
            f"experiment.output_dir={tmp_path}",
            "experiment.name=hooks",
        ],
    )
    train(cfg, callbacks=[timeline])

    # Epoch 2's loss is lower than epoch 1's: the best moves with each epoch's evaluation.
    def epoch(e, s0):  # epoch e, whose first step is s0 + 1
        before = e - 1 or None  # the best epoch before this one's evaluation
        return [
            ("on_epoch_start", e, s0, e - 1, before, None),
            ("on_step_end", e, s0 + 1, e - 1, before, None),
            ("on_log", e, s0 + 1, e - 1, before, None),
            ("on_step_end", e, s0 + 2, e - 1, before, None),
            ("on_log", e, s0 + 2, e - 1, before, None),
            ("on_eval_end", e, s0 + 2, e - 1, e, "val"),
            ("on_epoch_end", e, s0 + 2, e, e, False),
            ("on_snapshot", e, s0 + 2, e, e, None),
        ]

    assert timeline.seen == [
        ("on_train_start", 0, 0, 0, None, None),
        *epoch(1, 0),
        *epoch(2, 2),
        ("on_eval_end", 2, 4, 2, 2, "test"),
        ("on_train_end", 2, 4, 2, 2, None),
    ]


# ---------------------------------------------------------------------------- any optimizer, any schedule


def _own(drift: Path, tmp_path: Path, name: str) -> list[str]:
    return [
        *_workload(drift, "two_layers", "noisy"),
        f"training.optimizer={drift}:optimizer",
        f"training.schedule={drift}:schedule",
        "training.schedule_options.floor=0.0001",
        "training.lr=0.01",
        "training.batch_size=8",
        "training.epochs=2",
        "logging.trackers=[]",
        "logging.progress=false",
        "logging.log_every=1",
        "checkpoint.every=2",
        f"experiment.output_dir={tmp_path}",
        f"experiment.name={name}",
    ]


def _snapshot(run: Path) -> dict:
    ck = Checkpointer(run / "checkpoints", is_main=False)
    return load_snapshot(ck.latest())


def test_a_users_optimizer_with_two_groups_and_schedule_resume_bit_identically_after_a_sigkill(tmp_path, drift):
    ref = train(load_config(None, _own(drift, tmp_path, "ref")))
    lrs = [row["lr"] for row in ref["steps"]]
    assert lrs[0] < 0.01 and lrs[-1] < lrs[0]  # the user's cosine, not ddplab's warm-up
    snap = _snapshot(tmp_path / "ref")
    groups = snap["optimizer"]["param_groups"]
    assert len(groups) == 2 and groups[0]["initial_lr"] == pytest.approx(groups[1]["initial_lr"] * 0.1)
    assert (groups[0]["weight_decay"], groups[1]["weight_decay"]) == (0.0, 0.01)
    assert snap["scheduler"]["T_max"] == 12 and snap["scheduler"]["last_epoch"] == 12

    args = _own(drift, tmp_path, "kill")
    killed = subprocess.run(
        command("kill_rank=0,step=7", ["train", *args]),
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = train(load_config(None, args))
    assert resumed["aggregates"]["resumes"] == 1
    assert [(r["step"], r["loss"], r["lr"]) for r in resumed["steps"]] == [
        (r["step"], r["loss"], r["lr"]) for r in ref["steps"]
    ]
    mine, theirs = _snapshot(tmp_path / "kill"), snap
    assert all(torch.equal(mine["model"][k], theirs["model"][k]) for k in theirs["model"])


def test_under_fsdp_a_users_optimizer_and_schedule_resume_exactly_after_a_sigkill(tmp_path, drift):
    def job(name, fault=None):
        """2 processes: launched by `ddplab train --nproc-per-node 2`, or with `fault` under torchrun."""
        args = [
            *_own(drift, tmp_path, name),
            "training.batch_size=4",
            "distributed.strategy=fsdp",
            "distributed.timeout=60",
        ]
        if fault is None:
            return ddplab_cli("train", "--nproc-per-node", "2", *args, cwd=tmp_path)
        return subprocess.run(
            command(fault, ["train", *args], nproc=2),
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )

    assert_ok(job("ref"))
    assert job("kill", "kill_rank=1,step=7").returncode != 0
    resumed = job("kill")
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout, resumed.stdout[-2000:]
    ref, resumed = _summary(tmp_path / "ref"), _summary(tmp_path / "kill")
    assert resumed["aggregates"]["resumes"] == 1 and resumed["aggregates"]["steps"] == 12
    assert [(r["step"], r["loss"], r["lr"]) for r in resumed["steps"]] == [
        (r["step"], r["loss"], r["lr"]) for r in ref["steps"]
    ]


def test_a_time_budget_replans_ddplabs_schedules_and_leaves_a_users_as_built():
    from types import SimpleNamespace

    from ddplab.engine.loop.optim import plan_for_budget

    one_rank = SimpleNamespace(device=torch.device("cpu"), all_reduce=lambda t, op="sum": t)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    own = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    before = own.state_dict()
    plan_for_budget(own, one_rank, step=10, elapsed_s=10.0, budget_s=20.0)
    assert own.state_dict() == before


def test_verify_passes_with_a_users_optimizer_schedule_and_dropout(tmp_path, drift):
    args = [a for a in _own(drift, tmp_path, "v") if not a.startswith(("experiment.name", "checkpoint.every"))]
    proc = verify("--nproc", "2", *args, "training.max_steps=6", cwd=tmp_path)
    assert_ok(proc)
    assert "randomness: dropout off in both runs" in proc.stdout and "PASS" in proc.stdout


def test_verify_names_batchnorm_when_only_it_remains(tmp_path, drift):
    args = [a for a in _own(drift, tmp_path, "v") if not a.startswith(("experiment.name", "checkpoint.every"))]
    proc = verify("--nproc", "2", *args, f"model.name={drift}:normed", "training.max_steps=6", cwd=tmp_path)
    assert "randomness: 1 BatchNorm module(s): each of the 2 processes normalises its own 8 samples" in proc.stdout
    assert proc.returncode == 1 and "FAIL (see the randomness named above)" in proc.stdout, proc.stdout


def test_any_torch_optimizer_by_name_with_its_options(tmp_path, drift):
    summary = train(
        load_config(
            None,
            [
                *_workload(drift, "two_layers", "noisy"),
                "training.optimizer=RMSprop",
                "training.optimizer_options.alpha=0.9",
                "training.max_steps=3",
                "logging.trackers=[]",
                "logging.progress=false",
                f"experiment.output_dir={tmp_path}",
                "experiment.name=rms",
            ],
        )
    )
    assert summary["status"] == "complete" and math.isfinite(summary["steps"][-1]["loss"])
    snap = _snapshot(tmp_path / "rms")
    assert snap["optimizer"]["param_groups"][0]["alpha"] == 0.9


def _refused(argv: list[str], capfd) -> str:
    """`ddplab ARGV` in this process: exit 2 and one line on stderr; its text."""
    code = main(argv)
    err = capfd.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err[-2000:])
    return err


@pytest.mark.parametrize(
    "override, phrase",
    [
        ("training.optimizer=Nesterov", "unknown optimizer 'Nesterov'"),
        ("training.schedule=steps", "unknown schedule 'steps'"),
        ("training.optimizer=nowhere.py:opt", "no such file"),
        ("training.optimizer_options.nonsense=1", "refused them"),
        ("training.early_stopping.mode=lowest", "training.early_stopping.mode"),
    ],
)
def test_a_bad_optimizer_schedule_or_early_stopping_is_refused_in_one_line_before_any_process(
    tmp_path, drift, override, phrase, monkeypatch, capfd
):
    monkeypatch.chdir(tmp_path)
    err = _refused(
        [
            "train",
            "--nproc-per-node",
            "2",
            *_workload(drift, "two_layers", "noisy"),
            "training.optimizer=RMSprop",
            override,
        ],
        capfd,
    )
    assert phrase in err and not (tmp_path / "experiments").exists()


def test_sync_batchnorm_without_cuda_is_refused_in_one_line_before_any_process(tmp_path, drift, monkeypatch, capfd):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.chdir(tmp_path)
    err = _refused(
        ["train", "--nproc-per-node", "2", *_workload(drift, "normed", "noisy"), "distributed.sync_batchnorm=true"],
        capfd,
    )
    assert "distributed.sync_batchnorm=true needs CUDA" in err and not (tmp_path / "experiments").exists()


def test_sync_batchnorm_converts_every_batchnorm_below_the_root_before_the_model_is_wrapped():
    """The conversion itself, where CPU can show it (SyncBatchNorm's forward needs CUDA; the test below runs it)."""
    from types import SimpleNamespace

    from ddplab.engine.loop.setup import distribute

    inner = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    model = torch.nn.Sequential(inner, torch.nn.BatchNorm2d(3))
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = read_config(None, ["distributed.sync_batchnorm=true"])  # types only: load_config refuses it without CUDA
    wrapped, _ = distribute(model, cfg, SimpleNamespace(device=torch.device("cpu"), is_distributed=False))
    norms = [type(m).__name__ for m in wrapped.modules() if "Norm" in type(m).__name__]
    assert norms == ["SyncBatchNorm", "SyncBatchNorm"]
    assert all(torch.equal(plain[k], v) for k, v in wrapped.state_dict().items())  # same keys, same values


@pytest.mark.gpu
def test_sync_batchnorm_converts_the_models_batchnorm_on_cuda(tmp_path, drift):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    seen = []

    class Look(ddplab.Callback):
        def on_train_start(self, view):
            seen.append(type(view.model.norm).__name__)

    cfg = load_config(
        None,
        [
            *_workload(drift, "normed", "noisy"),
            "distributed.sync_batchnorm=true",
            "training.max_steps=2",
            "logging.trackers=[]",
            "logging.progress=false",
            f"experiment.output_dir={tmp_path}",
        ],
    )
    assert train(cfg, callbacks=[Look()])["status"] == "complete" and seen == ["SyncBatchNorm"]


def test_an_unused_parameter_under_ddp_fails_in_one_line_naming_it_and_the_setting(tmp_path, drift):
    args = [
        *_workload(drift, "spare", "noisy"),
        "training.max_steps=3",
        "logging.trackers=[]",
        "logging.progress=false",
        "distributed.timeout=60",
        "experiment.name=spare",
    ]
    proc = ddplab_cli("train", "--nproc-per-node", "2", *args, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert (
        "parameters without a gradient (spare.weight, spare.bias): set distributed.find_unused_parameters=true"
        in proc.stderr
    ), proc.stderr[-2000:]
    assert _summary(tmp_path / "experiments" / "spare")["status"] == "failed"


def test_a_model_returned_compiled_is_trained_and_saved_as_the_plain_module(tmp_path, drift):
    summary = train(
        load_config(
            None,
            [
                *_workload(drift, "compiled", "noisy"),
                "training.max_steps=2",
                "logging.trackers=[]",
                "logging.progress=false",
                f"experiment.output_dir={tmp_path}",
                "experiment.name=compiled",
            ],
        )
    )
    assert summary["status"] == "complete"
    keys = set(_snapshot(tmp_path / "compiled")["model"])
    assert keys == {"body.weight", "body.bias", "head.weight", "head.bias"}


def test_a_scaler_builder_is_handed_the_training_section_read_only(tmp_path, drift):
    """Builders hand each builder its part of the config: the scaler, the training section (frozen)."""
    from dataclasses import FrozenInstanceError

    from ddplab.config import TrainingConfig
    from ddplab.engine.loop.parts import Builders, grad_scaler

    seen = []

    def scaler(t, ctx):
        seen.append(t)
        with pytest.raises(FrozenInstanceError, match="'training.amp' cannot change"):
            t.amp = "fp16"
        return grad_scaler(t, ctx)

    args = [*_workload(drift), *SGD, "training.epochs=1", f"experiment.output_dir={tmp_path}", "experiment.name=s"]
    summary = train(load_config(None, args), builders=Builders(scaler=scaler))
    assert summary["status"] == "complete" and len(seen) == 1 and isinstance(seen[0], TrainingConfig)
