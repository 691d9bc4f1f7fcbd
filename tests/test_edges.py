"""Guarantees at the edges: a run folder's code runs only where the user said so, and every write stays
inside the run folder without clobbering anything (links, --output, the lock, the launcher's channel)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import ddplab
from conftest import _env
from ddplab.cli import main
from ddplab.engine.run_folder.files import open_append, write_atomic
from ddplab.engine.run_folder.lock import LOCKED_ENV, RunLock
from ddplab.engine.snapshots.manifest import seal
from ddplab.engine.snapshots.write import Checkpointer
from ddplab.errors import RunError, UserError
from ddplab.runtime.handoff import Handoff

FAST = ["logging.trackers=[]", "logging.progress=false", "training.epochs=1", "training.batch_size=32"]

WORKLOAD = """
import torch
import ddplab
from torch.utils.data import TensorDataset


def data(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g)
    y = x.sum(1)
    return ddplab.Data(train=TensorDataset(x[:64], y[:64]), val=TensorDataset(x[64:], y[64:]),
                       task=ddplab.Regression())


def model(cfg, data):
    return torch.nn.Linear(6, 1)
"""
SENTINEL = "import pathlib\npathlib.Path({!r}).write_text('ran')\n"


def _tree(folder: Path) -> dict[str, str]:
    """Every file's bytes (as a digest) under a folder."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _code(argv: list[str]) -> int:
    """main's exit code; a RunError (a failure at run time) counts as exit 1."""
    try:
        return main(argv)
    except RunError as err:
        print(f"ddplab: error: {err}", file=sys.stderr)
        return 1


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    """This machine's record of trained code, in a folder of the tests' own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
        yield mp


@pytest.fixture(scope="module")
def trained(tmp_path_factory, state):
    """A finished run of a user workload, trained in-process: (its folder, its wl.py)."""
    home = tmp_path_factory.mktemp("trained")
    wl = home / "wl.py"
    wl.write_text(WORKLOAD)
    cwd = os.getcwd()
    os.chdir(home)
    try:
        assert main(["train", f"model.name={wl}:model", f"data.name={wl}:data", "experiment.name=r", *FAST]) == 0
    finally:
        os.chdir(cwd)
    return home / "experiments" / "r", wl


def _plant(run: Path, dest: Path, reference: str | None = None, code: str = "") -> Path:
    """A copy of `run` at `dest` whose checkpoint names `dest/wl.py` (the copy's own code, with `code` at
    its top) or `reference`, as a downloaded run folder would; returns its checkpoint."""
    shutil.copytree(run, dest)
    (dest / "wl.py").write_text(code + WORKLOAD)
    best = dest / "checkpoints" / "best"
    manifest = json.loads((best / "COMPLETE").read_text())  # the run's config lives in the manifest
    for section in ("model", "data"):
        manifest["config"][section]["name"] = reference or f"{dest / 'wl.py'}:{section}"
    (best / "COMPLETE").write_text(json.dumps(seal(manifest)))  # resealed: a manifest guards against damage only
    return best


# ---------------------------------------------------------------------------- whose code runs


def test_code_this_machine_trained_with_runs_without_the_flag(trained, tmp_path, monkeypatch, capfd):
    run, wl = trained
    monkeypatch.chdir(tmp_path)  # elsewhere: the code lies outside the current folder
    assert main(["predict", str(run), "1,2,3,4,5,6"]) == 0
    assert f"importing model.name code from {wl}" in capfd.readouterr().err


@pytest.mark.parametrize("where", ["under_cwd", "site-packages"])
def test_a_planted_run_folders_code_runs_only_with_trust_code(trained, tmp_path, monkeypatch, capfd, where):
    sentinel = tmp_path / "ran"
    dest = tmp_path / ("downloaded/r" if where == "under_cwd" else "lib/site-packages/r")
    best = _plant(trained[0], dest, code=SENTINEL.format(str(sentinel)))
    monkeypatch.chdir(tmp_path)
    for command in (["predict", str(best), "1,2,3,4,5,6"], ["generate", str(best)]):
        assert main(command) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--trust-code" in err[0] and "not code this machine trained with" in err[0], err
        assert not sentinel.exists()
    assert main(["predict", str(best), "1,2,3,4,5,6", "--trust-code"]) == 0
    assert sentinel.read_text() == "ran"


def test_a_module_in_the_current_folder_is_no_installed_module(trained, tmp_path, monkeypatch, capfd):
    sentinel = tmp_path / "ran"
    best = _plant(trained[0], tmp_path / "r", reference="wl_planted:model", code=SENTINEL.format(str(sentinel)))
    (tmp_path / "r" / "wl.py").rename(tmp_path / "r" / "wl_planted.py")
    monkeypatch.chdir(tmp_path / "r")
    monkeypatch.syspath_prepend(str(tmp_path / "r"))  # as `python -m ddplab` puts the current folder first
    assert main(["predict", str(best), "1,2,3,4,5,6"]) == 2
    assert "--trust-code" in capfd.readouterr().err and not sentinel.exists()
    assert "wl_planted" not in sys.modules


def test_a_checkpoint_naming_a_module_inside_a_module_imports_nothing(trained, tmp_path, monkeypatch, capfd):
    best = _plant(trained[0], tmp_path / "r", reference="this.x:model")
    monkeypatch.chdir(tmp_path)
    had = "this" in sys.modules
    assert main(["predict", str(best), "1,2,3,4,5,6"]) == 2
    out, err = capfd.readouterr()
    assert "no module named 'this.x'" in err and "Zen of Python" not in out
    assert ("this" in sys.modules) == had


# ---------------------------------------------------------------------------- links planted in a run folder

LINKS = [
    ".metrics.json.tmp",
    ".metrics.csv.tmp",
    ".config.yaml.tmp",
    ".env.json.tmp",
    ".heartbeat.json.tmp",
    ".lock.tmp",
    "train.log",
    "config.yaml",
    "metrics.csv",
    "logs",
]


@pytest.mark.parametrize("name", LINKS)
def test_a_link_planted_in_a_run_folder_is_never_written_through(trained, tmp_path, monkeypatch, capfd, name):
    _, wl = trained
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    run = tmp_path / "experiments" / "x"
    run.mkdir(parents=True)
    (run / name).symlink_to(target)
    code = _code(["train", f"model.name={wl}:model", f"data.name={wl}:data", "experiment.name=x", *FAST])
    assert target.read_text() == "keep me\n" and (run / name).is_symlink()
    if name.startswith("."):  # a temporary name is never one a writer uses
        assert code == 0
    elif name == "config.yaml":  # read first, by the resume check: not a config of this run
        assert code == 2 and "config.yaml is unreadable" in capfd.readouterr().err
    elif name != "logs":  # logs/ is written only when a rank fails
        assert code == 1 and "symbolic link" in capfd.readouterr().err


def test_atomic_writes_refuse_links_and_never_share_a_temporary_file(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("x")
    run = tmp_path / "run"
    run.mkdir()
    (run / "a.json").symlink_to(outside)
    (run / "sub").symlink_to(tmp_path)
    for writer in (
        lambda: write_atomic(run, "a.json", "y"),
        lambda: open_append(run, "a.json"),
        lambda: write_atomic(run, "sub/b.json", "y"),
    ):
        with pytest.raises(RunError, match="symbolic link"):
            writer()
    assert outside.read_text() == "x" and not (tmp_path / "b.json").exists()

    errors = []

    def hammer(i):
        try:
            for j in range(100):
                write_atomic(run, "m.json", f"{i} {j}")
        except Exception as exc:  # noqa: BLE001 - any failure fails the test
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and (run / "m.json").read_text().split()[1] == "99"
    assert sorted(p.name for p in run.iterdir()) == ["a.json", "m.json", "sub"]  # no temporary file left


# ---------------------------------------------------------------------------- experiment.name


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", ".", "..", "a\nb", "a\x1b[31mb", "a\\b"])
def test_experiment_name_is_one_plain_folder_name(tmp_path, monkeypatch, capfd, name):
    monkeypatch.chdir(tmp_path)
    assert main(["train", f"experiment.name={name}", "logging.trackers=[]"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "experiment.name" in err[0] and "plain folder name" in err[0], err
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- --output


def test_output_never_replaces_a_file_nor_writes_into_a_run_folder_without_force(trained, tmp_path, monkeypatch, capfd):
    run, _ = trained
    monkeypatch.chdir(tmp_path)
    before = _tree(run)
    existing = tmp_path / "p.csv"
    existing.write_text("mine\n")
    link = tmp_path / "link.csv"
    link.symlink_to(existing)
    refused = {
        ("predict", str(run), "1,2,3,4,5,6", "--output", str(existing)): "the file exists",
        ("predict", str(run), "1,2,3,4,5,6", "--output", str(run / "new.csv")): "inside the run folder",
        ("predict", str(run), "1,2,3,4,5,6", "--output", str(link), "--force"): "symbolic link",
        ("predict", str(run), "1,2,3,4,5,6", "--output", str(tmp_path), "--force"): "name a .csv or a .jsonl",
        ("export", str(run), "--output", str(run / "config.yaml")): "the file exists",
        ("export", str(run), "--output", str(existing)): "the file exists",
        ("export", str(run), "--output", str(link), "--force"): "symbolic link",
        ("export", str(run), "--output", str(tmp_path)): "a folder",
        ("report", str(run), "--output", str(existing)): "give a folder",
    }
    for argv, phrase in refused.items():
        assert main(list(argv)) == 2, argv
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and phrase in err[0], (argv, err)
    assert _tree(run) == before and existing.read_text() == "mine\n"

    assert main(["predict", str(run), "1,2,3,4,5,6", "--output", str(existing), "--force"]) == 0
    assert existing.read_text().startswith("input,") and link.is_symlink()
    assert main(["export", str(run), "--output", str(tmp_path / "m.safetensors")]) == 0
    assert main(["export", str(run), "--output", str(tmp_path / "m.safetensors")]) == 2
    assert main(["export", str(run), "--output", str(tmp_path / "m.safetensors"), "--force"]) == 0


def test_report_output_refuses_a_report_already_there_unless_force(trained, tmp_path, capfd):
    pytest.importorskip("matplotlib")
    run, _ = trained
    out = tmp_path / "rep"
    assert main(["report", str(run), "--output", str(out)]) == 0
    first = (out / "report.md").read_text()
    assert main(["report", str(run), "--output", str(out)]) == 2
    assert "pass --force" in capfd.readouterr().err and (out / "report.md").read_text() == first
    assert main(["report", str(run), "--output", str(out), "--force"]) == 0


# ---------------------------------------------------------------------------- the launcher's channel


def test_a_forged_locked_run_takes_no_lock_from_anyone(trained, tmp_path, monkeypatch, capfd):
    run, wl = trained
    done = tmp_path / "experiments" / "done"
    shutil.copytree(run, done)
    before = _tree(done)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(LOCKED_ENV, str(done))
    monkeypatch.setenv(Handoff.variable("lock_token"), "guessed")
    assert main(["train", f"model.name={wl}:model", f"data.name={wl}:data", "experiment.name=other", *FAST]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and LOCKED_ENV in err[0], err
    assert _tree(done) == before and not (tmp_path / "experiments" / "other").exists()


def test_a_worker_believes_the_launcher_that_holds_its_run_folder(tmp_path):
    probe = [sys.executable, "-c", "from ddplab.engine.run_folder.lock import launcher_lock; print(launcher_lock())"]
    with RunLock(tmp_path / "run") as lock:
        ok = subprocess.run(probe, env={**_env(), **lock.worker_env()}, capture_output=True, text=True)
        assert ok.returncode == 0 and ok.stdout.strip() == str(tmp_path / "run"), ok.stderr
        forged = subprocess.run(
            probe,
            env={**_env(), **lock.worker_env(), Handoff.variable("lock_token"): "0" * 32},
            capture_output=True,
            text=True,
        )
        assert forged.returncode == 1 and LOCKED_ENV in forged.stderr
    gone = subprocess.run(probe, env={**_env(), **lock.worker_env()}, capture_output=True, text=True)
    assert gone.returncode == 1  # released: nobody holds it any more


# ---------------------------------------------------------------------------- the lock under a race


def test_a_thousand_simultaneous_starts_never_fail_but_in_one_line(tmp_path):
    """Rounds of starts of one (new) run folder at the same instant: one wins, the others are told it is
    in use; the winner's folder stays while it holds it, and it removes the folder it made at release."""
    run, per_round, rounds = tmp_path / "out" / "run", 8, 125
    barrier = threading.Barrier(per_round)
    unexpected, wins = [], []

    def start():
        for _ in range(rounds):
            barrier.wait()
            try:
                lock = RunLock(run).acquire()
            except UserError as err:
                if "is in use by" not in str(err):
                    unexpected.append(err)
                continue
            except Exception as exc:  # noqa: BLE001 - what the race used to raise
                unexpected.append(exc)
                continue
            try:
                write_atomic(run, "metrics.json", "{}")  # what a run writes while it holds the folder
                assert json.loads((run / ".lock").read_text())["token"] == lock.token
                (run / "metrics.json").unlink()
                wins.append(1)
            except Exception as exc:  # noqa: BLE001
                unexpected.append(exc)
            finally:
                lock.release()

    threads = [threading.Thread(target=start) for _ in range(per_round)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert unexpected == [], f"{len(unexpected)} of {per_round * rounds} starts failed: {unexpected[:3]}"
    assert len(wins) >= rounds
    # What is left is at most an empty folder (made by a start that lost to one that found it there).
    assert not run.exists() or list(run.iterdir()) == []


# ---------------------------------------------------------------------------- failures told for what they are


class _Raises(ddplab.Callback):
    """Raises `error` at the end of step `at`; with `reason`, asks for a stop there instead."""

    def __init__(self, error: BaseException | None = None, at: int = 1, reason: str = "") -> None:
        self.error, self.at, self.reason = error, at, reason

    def on_step_end(self, view) -> None:
        if view.step == self.at and self.reason:
            view.request_stop(self.reason)
        elif view.step == self.at and self.error is not None:
            raise self.error


def _train_with(trained, place: Path, callback: ddplab.Callback, *extra: str) -> dict:
    _, wl = trained
    os.chdir(place)
    args = [f"model.name={wl}:model", f"data.name={wl}:data", "experiment.name=cb", "logging.log_every=1", *FAST]
    return ddplab.train(None, [*args, "training.epochs=3", *extra], callbacks=[callback])


def _status(place: Path) -> dict:
    return json.loads((place / "experiments" / "cb" / "metrics.json").read_text())


@pytest.mark.parametrize("code", [0, 3, None])
def test_a_callbacks_system_exit_fails_the_run(trained, tmp_path, monkeypatch, code):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunError, match=rf"callback _Raises.on_step_end raised SystemExit\({code}\)"):
        _train_with(trained, tmp_path, _Raises(SystemExit(code)))
    summary = _status(tmp_path)
    assert summary["status"] == "failed" and "SystemExit" in summary["failure"]["summary"], summary


class _Assigns(ddplab.Callback):
    """Steers by changing the config, which a callback only reads."""

    def on_step_end(self, view) -> None:
        view.config.training.lr = 1.0


def test_a_callback_that_assigns_to_the_config_fails_the_run_naming_the_key(trained, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunError, match="FrozenInstanceError: .* 'training.lr' cannot change"):  # as any exception
        _train_with(trained, tmp_path, _Assigns())
    summary = _status(tmp_path)
    assert summary["status"] == "failed" and "'training.lr' cannot change" in summary["failure"]["summary"], summary


def test_a_callbacks_keyboard_interrupt_is_a_ctrl_c(trained, tmp_path, monkeypatch, capfd):
    """Exit 130 and status interrupted (not a pre-emption: nothing requeues it), a snapshot at the next log
    interval, and the same command continues the run."""
    _, wl = trained
    monkeypatch.chdir(tmp_path)
    args = ["train", f"model.name={wl}:model", f"data.name={wl}:data", "experiment.name=cb", "logging.log_every=1"]
    args += [*FAST, "training.epochs=3"]
    monkeypatch.setattr(
        "ddplab.commands.run.configured", lambda cfg: [_Raises(KeyboardInterrupt())]
    )  # as a user's callback
    assert main(args) == ddplab.ExitCode.INTERRUPTED == 130
    summary = _status(tmp_path)
    assert summary["status"] == summary["stop_reason"] == "interrupted"
    out, err = capfd.readouterr()
    assert "stop signal (KeyboardInterrupt in callback _Raises.on_step_end) after step 1" in out, out
    assert "interrupted after step 1; the same command continues from the snapshot" in out, out
    assert "Traceback" not in err and "Traceback" not in out
    assert Checkpointer(tmp_path / "experiments" / "cb" / "checkpoints", is_main=False).latest().name.endswith("1")
    assert main(["status", str(tmp_path / "experiments" / "cb")]) == 130
    assert capfd.readouterr().out == "interrupted\n"

    monkeypatch.setattr("ddplab.commands.run.configured", lambda cfg: [])
    assert main(args) == 0  # the same command continues
    summary = _status(tmp_path)
    assert summary["status"] == "complete" and summary["aggregates"]["resumes"] == 1, summary["aggregates"]
    assert "resumed from experiments/cb/checkpoints/step-000000001 (epoch 1, step 1," in capfd.readouterr().out


def test_a_stop_reason_is_one_printable_line(trained, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    summary = _train_with(trained, tmp_path, _Raises(reason="enough\n\x1b[2J\x1b[31mred"))
    shown = "enough\\n\\x1b[2J\\x1b[31mred"
    assert summary["stop_reason"] == shown
    out = capfd.readouterr().out
    log = (tmp_path / "experiments" / "cb" / "train.log").read_text()
    for text in (out, log):
        assert "\x1b" not in text and f"stop requested ({shown}, by a callback on rank 0) after step 1" in text


def test_a_refused_resume_leaves_the_run_failed_with_its_reason(trained, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    assert _train_with(trained, tmp_path, _Raises(KeyboardInterrupt()))["status"] == "interrupted"
    log = tmp_path / "experiments" / "cb" / "train.log"
    log.rename(tmp_path / "elsewhere.log")
    log.symlink_to(tmp_path / "elsewhere.log")
    with pytest.raises(RunError, match="refusing to write .*train.log: it is a symbolic link"):
        _train_with(trained, tmp_path, ddplab.Callback())
    summary = _status(tmp_path)
    assert summary["status"] == "failed" and "symbolic link" in summary["failure"]["summary"], summary
    assert main(["status", str(tmp_path / "experiments" / "cb")]) == 1
