"""One owner per run folder (real processes), and which config fields resume=auto lets change.
A changed config meeting an unfinished run is among the cases of test_bad_inputs.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import warm

from conftest import TINY_GPT, _env, main
from ddplab.engine.run_folder.lock import HOLDER_FILE, RunLock
from ddplab.engine.snapshots.fingerprint import SAFE_TO_CHANGE, differences, safe
from ddplab.errors import UserError


def test_a_second_lock_on_the_same_folder_names_the_holder_and_release_leaves_nothing(tmp_path):
    run = tmp_path / "out" / "run"
    first = RunLock(run).acquire()
    info = json.loads((run / HOLDER_FILE).read_text())
    assert info["pid"] > 0 and info["host"]
    with pytest.raises(UserError, match=rf"in use by another ddplab job \(host {info['host']}, PID {info['pid']}\)"):
        RunLock(run).acquire()  # another open file description: flock conflicts even within one process
    first.release()
    assert not (tmp_path / "out").exists()  # created by the lock, left empty: removed
    with RunLock(run):  # free again
        pass


@pytest.mark.parametrize(
    "where, says",
    [
        (lambda tmp: tmp / "gone" / "out", "gone is a symbolic link to nowhere"),
        (lambda tmp: tmp / "gone", "a symbolic link to nowhere"),
        (lambda tmp: Path("/proc/ddplab-out"), "/proc is a folder that takes no new ones"),
    ],
)
def test_an_output_dir_that_cannot_hold_a_folder_is_one_line_not_a_recursion(tmp_path, monkeypatch, capfd, where, says):
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    code = main("train", f"experiment.output_dir={where(tmp_path)}", "training.max_steps=1", *TINY_GPT)
    err = capfd.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("ddplab: error: cannot create run folder"), err[-2000:]
    assert says in err and "experiment.output_dir" in err, err
    assert not (tmp_path / "nowhere").exists()


def test_fingerprint_allows_only_the_documented_fields():
    old = {
        "training": {"epochs": 2, "batch_size": 8, "max_steps": None},
        "logging": {"log_every": 10},
        "model": {"dim": 32},
    }
    new = {
        "training": {"epochs": 5, "batch_size": 8, "max_steps": 100},
        "logging": {"log_every": 1},
        "model": {"dim": 32},
    }
    assert differences(old, new) == []
    new["model"]["dim"] = 64
    new["training"]["batch_size"] = 64  # safe: a resume keeps the global batch by recomputing the accumulation
    new["training"]["weight_decay"], old["training"]["weight_decay"] = 0.5, 0.0
    assert differences(old, new) == [("training.weight_decay", 0.0, 0.5), ("model.dim", 32, 64)]
    assert safe("logging.trackers") and not safe("training.lr") and "training.time_budget" in SAFE_TO_CHANGE


def _start(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        warm.command([sys.executable, "-m", "ddplab", *args]),
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_simultaneous_starts_one_runs_the_other_exits_2(tmp_path, corpus):
    # One epoch of ~60 KB at batch 8 keeps the winner busy for seconds after the loser's check.
    args = [
        "train",
        f"data.path={corpus}",
        *TINY_GPT,
        "training.epochs=1",
        "generate.max_new_tokens=0",
        "experiment.name=same",
    ]
    procs = [_start(tmp_path, *args), _start(tmp_path, *args)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [r[2][-2000:] for r in results]
    loser = next(err for code, _, err in results if code == 2)
    lines = loser.strip().splitlines()
    assert len(lines) == 1 and "experiments/same is in use by another ddplab job (host" in lines[0], loser
    winner = next(out for code, out, _ in results if code == 0)
    assert "run folder experiments/same" in winner
    assert [p.name for p in (tmp_path / "experiments").iterdir()] == ["same"]  # no second folder either
    assert not (tmp_path / "experiments" / "same" / HOLDER_FILE).exists()  # released at the end
    log = (tmp_path / "experiments" / "same" / "train.log").read_text()
    assert log.count("world size 1") == 1  # one job wrote the folder
