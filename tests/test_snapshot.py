"""Snapshots as named stateful parts under a checksummed manifest (engine/snapshots/:
write.py, manifest.py): the manifest written, verified and tampered with in-process; a workload's own part
restored after a SIGKILL (DDP and FSDP, 2 processes); damaged snapshots skipped in one line for the previous
one; the resume check made against the snapshot's own config."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import ddplab
import faults
from conftest import _env, assert_ok, main
from ddplab.engine.loop.view import CallbackList
from ddplab.engine.parallel.distributed import DistContext, LaunchInfo
from ddplab.engine.snapshots import manifest
from ddplab.engine.snapshots.manifest import MARKER, Damaged
from ddplab.engine.snapshots.read import STATE, load_checkpoint, load_snapshot, open_snapshot
from ddplab.engine.snapshots.write import PER_RANK, Checkpointer, Parts, part
from ddplab.errors import UserError
from faults import command

ONE = DistContext(LaunchInfo("none"), None, torch.device("cpu"))

# A workload with a part of its own: a counter of the training forward passes of each rank. Nothing
# else in it, or in ddplab, knows of the counter: Data(state=...) is its one registration.
WORKLOAD = """
import torch

import ddplab
import ddplab
from torch.utils.data import TensorDataset


class Counter:
    def __init__(self, rank):
        self.passes, self.rank = 0, rank

    def state_dict(self):
        return {"passes": self.passes, "rank": self.rank}

    def load_state_dict(self, state):
        self.passes, self.rank = state["passes"], state["rank"]


def data(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(160, 6, generator=g)
    y = x @ torch.linspace(-1, 1, 6) + 0.1 * torch.randn(160, generator=g)
    return ddplab.Data(train=TensorDataset(x[:128], y[:128]), val=TensorDataset(x[128:], y[128:]),
                       task=ddplab.Regression(), state={"counter": Counter(cfg.rank)})


def model(cfg, data):
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    counter = data.state["counter"]

    def count(module, inputs):
        if module.training:
            counter.passes += 1
    net.register_forward_pre_hook(count)
    return net
"""


# ---------------------------------------------------------------------------- in-process: the manifest


def _parts(value: float, step: int) -> Parts:
    parts = Parts()
    parts.add("model", part(lambda: {"w": torch.full((1000,), value)}))
    parts.add("trainer", part(lambda: {"step": step}))
    return parts


def _save(ck: Checkpointer, step: int, **info) -> Path:
    return ck.save(
        _parts(float(step), step),
        ONE,
        f"step-{step:09d}",
        {"step": step, "world_size": 1, "global_batch": 8, "config": {"training": {"lr": 0.1}}, **info},
    )


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_manifest_names_every_file_with_its_size_and_checksum(tmp_path):
    ck = Checkpointer(tmp_path, is_main=True)
    folder = _save(ck, 3)
    m = json.loads((folder / MARKER).read_text())
    assert m["format"] == manifest.FORMAT and m["step"] == 3 and m["config"] == {"training": {"lr": 0.1}}
    assert m["parts"] == {"model": STATE, "trainer": STATE} and m["checksum"] == "crc32c"
    size = (folder / STATE).stat().st_size
    assert m["files"] == {STATE: [size, manifest.checksum(folder / STATE)]}
    assert manifest.verify(folder) == m
    assert torch.equal(load_snapshot(folder)["model"]["w"], torch.full((1000,), 3.0))
    _flip(folder / STATE)
    with pytest.raises(Damaged, match="damaged"):
        manifest.verify(folder)


def test_without_checksums_a_manifest_checks_sizes_only(tmp_path):
    ck = Checkpointer(tmp_path, is_main=True, checksums=False)
    folder = _save(ck, 3)
    m = manifest.verify(folder)
    assert m["checksum"] is None and m["files"] == {STATE: [(folder / STATE).stat().st_size, None]}
    _flip(folder / STATE)
    assert manifest.verify(folder) == m  # what checkpoint.checksums=false gives up
    (folder / STATE).write_bytes((folder / STATE).read_bytes()[:-1])
    with pytest.raises(Damaged, match="truncated"):
        manifest.verify(folder)


def _edit(folder: Path, change, sealed: bool = True) -> None:
    """The snapshot's manifest changed by `change` (a function of the manifest dict), resealed with its
    own checksum unless `sealed` is false: so the check under test is the only one that can catch it."""
    m = json.loads((folder / MARKER).read_text())
    change(m)
    (folder / MARKER).write_text(json.dumps(manifest.seal(m) if sealed else m))


def _nulled_and_flipped(path: Path) -> None:
    """The file's manifest entry without its checksum, the file's bytes flipped: its size still agrees."""
    folder = next(p for p in path.parents if (p / MARKER).is_file())
    _edit(folder, lambda m: m["files"][path.relative_to(folder).as_posix()].__setitem__(1, None))
    _flip(path, (path.stat().st_size * 3) // 4)


def _linked_state(folder: Path) -> None:
    (folder / "real.pt").write_bytes((folder / STATE).read_bytes())
    (folder / STATE).unlink()
    (folder / STATE).symlink_to(folder / "real.pt")


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda f: _flip(f / STATE), "state.pt: damaged (its checksum differs"),
        (lambda f: (f / STATE).write_bytes((f / STATE).read_bytes()[:-10]), "state.pt: truncated"),
        (lambda f: (f / STATE).unlink(), "state.pt: missing"),
        (lambda f: (f / MARKER).write_text("{not json"), "COMPLETE: not a manifest (not JSON)"),
        (lambda f: (f / MARKER).write_text("[1, 2]"), "COMPLETE: not a manifest (a JSON list)"),
        (lambda f: (f / MARKER).write_text('{"step": "x"}'), "COMPLETE: not a manifest (no step)"),
        (lambda f: _edit(f, lambda m: m.update(step=3), sealed=False), "COMPLETE: damaged (the manifest's own"),
        (lambda f: _nulled_and_flipped(f / STATE), "COMPLETE: 'state.pt' has no checksum, where the manifest's"),
        (lambda f: _edit(f, lambda m: m.update(files={})), "COMPLETE: not a manifest (no files)"),
        (lambda f: _edit(f, lambda m: m["files"].update({STATE: 5})), "the entry of 'state.pt' is 5, not [size"),
        (
            lambda f: _edit(f, lambda m: m["files"].update({"../../../../etc/hostname": [1, "00000000"]})),
            "names '../../../../etc/hostname', a path outside its snapshot",
        ),
        (_linked_state, "state.pt: leads outside its snapshot (a symbolic link)"),
    ],
)
def test_a_tampered_snapshot_is_skipped_in_one_line_naming_the_file(tmp_path, damage, says):
    ck = Checkpointer(tmp_path, is_main=True)
    _save(ck, 2)
    damage(_save(ck, 4))
    with pytest.raises(Damaged, match=re.escape(says)):
        manifest.verify(tmp_path / "step-000000004")
    lines = []
    where, _, state = ck.newest(lines.append)
    assert where.name == "step-000000002" and state["trainer"]["step"] == 2
    assert len(lines) == 1 and "step-000000004" in lines[0] and says in lines[0], lines


def test_files_of_different_steps_are_refused(tmp_path):
    ck = Checkpointer(tmp_path, is_main=True)
    _save(ck, 2)
    four = _save(ck, 4)
    shutil.copy(tmp_path / "step-000000002" / STATE, four / STATE)  # step 2's state beside step 4's manifest
    with pytest.raises(Damaged, match="step-000000004/state.pt"):
        manifest.verify(four)
    shutil.copy(tmp_path / "step-000000002" / MARKER, four / MARKER)  # and a whole snapshot of step 2, misnamed
    with pytest.raises(Damaged, match="the manifest of step 2 in the folder of another step"):
        manifest.verify(four)
    _edit(four, lambda m: m.update(step=4, checksum=None, files={STATE: [(four / STATE).stat().st_size, None]}))
    with pytest.raises(Damaged, match="holds step 2, the manifest says step 4"):  # sizes alone agree, yet refused
        open_snapshot(four)


@pytest.mark.parametrize("version", [2, None, True])
def test_a_snapshot_of_another_format_is_untrusted_and_skipped_in_one_line(tmp_path, version):
    """Format 1 is the only one written; a snapshot of a later (or no) format is untrusted: passed over for the one
    before with a line naming why, and refused where it is named."""
    ck = Checkpointer(tmp_path, is_main=True)
    _save(ck, 2)
    four = _save(ck, 4)
    _edit(four, lambda m: m.update(format=version))
    says = f"step-000000004/COMPLETE: a snapshot of format {version!r}; ddplab {ddplab.__version__} reads format 1"
    lines: list[str] = []
    assert ck.newest(lines.append)[0].name == "step-000000002"
    assert len(lines) == 1 and lines[0].startswith("skipping snapshot step-000000004: ") and says in lines[0], lines
    with pytest.raises(Damaged, match=re.escape(says)):
        open_snapshot(four)


def test_predict_export_and_generate_take_the_best_model_only_once_it_verifies(tmp_path):
    ck = Checkpointer(tmp_path / "checkpoints", is_main=True)
    _save(ck, 2)
    best = ck.save(_parts(7.0, 2), ONE, "best", {"step": 2, "config": {"c": 1}})
    found, ckpt = load_checkpoint(tmp_path)
    assert found == best and ckpt["model"]["w"][0] == 7.0 and ckpt["config"] == {"c": 1}
    _flip(best / STATE)
    lines = []
    found, ckpt = load_checkpoint(tmp_path, lines.append)
    assert found.name == "step-000000002" and ckpt["model"]["w"][0] == 2.0
    assert len(lines) == 1 and "checkpoints/best/state.pt: damaged" in lines[0]
    with pytest.raises(UserError, match="best/state.pt: damaged"):  # named by the user: no other is tried
        load_checkpoint(best)


def test_parts_are_registered_once_each_and_per_rank_parts_stay_at_another_world_size(tmp_path):
    parts = Parts()
    parts.add("counter", part(lambda: {"n": 3}, lambda s: seen.append(s)), PER_RANK)
    with pytest.raises(UserError, match="two stateful parts are named 'counter'"):
        parts.add("counter", part(dict))
    with pytest.raises(UserError, match="stateful part 'x': int has no state_dict"):
        parts.add("x", 3)
    seen = []
    ck = Checkpointer(tmp_path, is_main=True)
    folder = ck.save(parts, ONE, "step-000000001", {"step": 1, "world_size": 1})
    assert torch.load(folder / STATE, weights_only=True) == {"counter": [{"n": 3}]}  # one state per rank
    plain = torch.load(folder / STATE, weights_only=True)
    assert parts.load(plain, folder, ONE, world_size=1) == [] and seen == [{"n": 3}]
    assert parts.load(plain, folder, ONE, world_size=2) == ["counter"] and seen == [{"n": 3}]


def test_callbacks_state_is_keyed_by_class_and_index():
    class Patience:
        def __init__(self, n):
            self.n = n

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    import ddplab

    class Stateless(ddplab.Callback):
        pass

    class Stop(Patience, ddplab.Callback):
        pass

    saved = CallbackList([Stop(1), Stateless(), Stop(2)]).state_dict()
    assert saved == {"Stop.0": {"n": 1}, "Stop.1": {"n": 2}}
    fresh = CallbackList([Stateless(), Stop(0), Stop(0), Stop(9)])  # one added since: it keeps its own
    fresh.load_state_dict(saved)
    assert [cb.n for cb in fresh.callbacks[1:]] == [1, 2, 9]


def test_the_launchers_readers_take_a_garbage_marker_and_the_snapshots_config(tmp_path):
    from ddplab.commands.train import check_global_batch
    from ddplab.engine.snapshots.fingerprint import check_resume
    from ddplab.registry import load_config

    run = tmp_path / "run"
    ck = Checkpointer(run / "checkpoints", is_main=True)
    _save(ck, 2, global_batch=16)
    (_save(ck, 4) / MARKER).write_text("[garbage")
    ck.keep_last = 3
    state = _save(ck, 6, global_batch=24) / STATE
    state.write_bytes(state.read_bytes()[:-10])  # truncated: the workers would skip it
    cfg = load_config(None, ["training.batch_size=8"])
    with pytest.raises(UserError, match="cannot keep the run's global batch of 16 on 3 processes"):
        check_global_batch(cfg, run, 3)  # step 2's manifest: step 4's marker and step 6's files skipped
    check_global_batch(cfg, run, 2)
    # No config.yaml at all: the snapshot's own config is the run's.
    with pytest.raises(UserError, match=r"training.lr: 0.1 -> 0.5"):
        check_resume(run, {"training": {"lr": 0.5}})
    check_resume(run, {"training": {"lr": 0.1}})


# ---------------------------------------------------------------------------- real runs


def _workload(folder: Path) -> Path:
    path = folder / "counter_wl.py"
    path.write_text(WORKLOAD)
    return path


def _args(wl: Path, name: str, strategy: str = "ddp", *extra: str) -> list[str]:
    return [
        "train",
        f"model.name={wl}:model",
        f"data.name={wl}:data",
        "training.epochs=1",
        "training.batch_size=8",
        "checkpoint.every=2",
        "logging.log_every=1",
        "logging.trackers=[]",
        "logging.progress=false",
        "distributed.timeout=60",
        f"distributed.strategy={strategy}",
        f"experiment.name={name}",
        *extra,
    ]


def _run(spec: str, args: list[str], cwd: Path, nproc: int | None = None, max_restarts: int = 0):
    return subprocess.run(
        command(spec, args, nproc, max_restarts),
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _final(run: Path) -> tuple[dict, dict]:
    """(the last snapshot's weights, its state.pt) of a finished run."""
    ck = Checkpointer(run / "checkpoints", is_main=False)
    return load_snapshot(ck.latest())["model"], torch.load(ck.latest() / STATE, weights_only=True)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_workloads_own_part_is_restored_exactly_after_sigkill(tmp_path, strategy):
    wl = _workload(tmp_path)
    # 128 samples, 2 ranks x 8: 8 steps; snapshots every 2; rank 1 killed after step 7, so step 6's is resumed.
    proc = _run("kill_rank=1,step=7", _args(wl, "k", strategy), tmp_path, nproc=2, max_restarts=1)
    assert_ok(proc)
    run = tmp_path / "experiments" / "k"
    assert "resumed from" in (run / "train.log").read_text() and "step-000000006" in (run / "train.log").read_text()
    _, state = _final(run)
    assert state["trainer"]["step"] == 8
    # Each rank's own counter came back: 6 passes restored + 2 taken after the resume (not 2, nor rank 0's).
    assert state["counter"] == [{"passes": 8, "rank": 0}, {"passes": 8, "rank": 1}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """One workload; per strategy, a run never interrupted and one pre-empted (SIGUSR1) after step 6 (snapshots
    of steps 4 and 6 kept), all of one process, this one: one adds nothing (an fsdp run of one process still
    writes DCP shards)."""
    root = tmp_path_factory.mktemp("runs")
    wl = _workload(root)
    out = {"root": root, "wl": wl}
    for strategy in ("ddp", "fsdp"):
        with contextlib.chdir(root):
            assert main(*_args(wl, f"ref-{strategy}", strategy)) == 0
            assert faults.main(["signal_rank=0,step=6", *_args(wl, f"stop-{strategy}", strategy)]) == 75
    return out


def _damaged_resume(runs: dict, tmp_path: Path, strategy: str, damage, capfd) -> tuple[str, str, Path]:
    """The pre-empted run copied, its newest snapshot damaged, then continued in this process: (what it
    printed to stdout, to stderr, the run)."""
    run = tmp_path / "experiments" / "stop"
    shutil.copytree(runs["root"] / "experiments" / f"stop-{strategy}", run)
    damage(run / "checkpoints" / "step-000000006")
    capfd.readouterr()
    with contextlib.chdir(tmp_path):
        code = main(*_args(runs["wl"], "stop", strategy))
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    return out, err, run


def _shard(folder: Path) -> Path:
    return next((folder / "shards").glob("*.distcp"))


def _older_state(folder: Path) -> None:
    shutil.copy(folder.parent / "step-000000004" / STATE, folder / STATE)


@pytest.mark.parametrize(
    "strategy, damage, names",
    [
        ("ddp", lambda f: _flip(f / STATE), "state.pt: damaged"),
        ("ddp", lambda f: (f / MARKER).write_text("\x00garbage"), "COMPLETE: not a manifest"),
        ("fsdp", lambda f: _flip(_shard(f), 100), ".distcp: damaged"),
        ("fsdp", lambda f: _shard(f).unlink(), ".distcp: missing"),
        ("fsdp", _older_state, "step-000000006/state.pt: "),  # step 4's state.pt beside step 6's shards
        ("ddp", lambda f: _nulled_and_flipped(f / STATE), "'state.pt' has no checksum"),
        ("fsdp", lambda f: _nulled_and_flipped(_shard(f)), ".distcp' has no checksum"),
    ],
)
def test_a_damaged_newest_snapshot_is_skipped_for_the_previous_one(runs, tmp_path, strategy, damage, names, capfd):
    out, err, run = _damaged_resume(runs, tmp_path, strategy, damage, capfd)
    skipped = [line for line in out.splitlines() if "skipping snapshot" in line]
    assert len(skipped) == 1 and "step-000000006" in skipped[0] and names in skipped[0], out[-3000:]
    assert "resumed from" in out and "step-000000004 (epoch 1, step 4" in out
    assert "Traceback" not in err
    mine, state = _final(run)
    theirs, ref = _final(runs["root"] / "experiments" / f"ref-{strategy}")
    assert state["trainer"]["step"] == ref["trainer"]["step"] == 16
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)  # as if never stopped
    assert state["counter"] == ref["counter"] == [{"passes": 16, "rank": 0}]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_export_refuses_a_snapshot_with_a_nulled_checksum_and_flipped_bytes(runs, tmp_path, strategy, capfd):
    run = tmp_path / "stop"
    shutil.copytree(runs["root"] / "experiments" / f"stop-{strategy}", run)
    six = run / "checkpoints" / "step-000000006"
    _nulled_and_flipped(six / STATE if strategy == "ddp" else _shard(six))
    capfd.readouterr()
    assert main("export", str(six), "--output", str(tmp_path / "six.safetensors")) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddplab: error: ") and "has no checksum" in err, err
    assert not (tmp_path / "six.safetensors").exists()
    assert main("export", str(run), "--output", str(tmp_path / "run.safetensors")) == 0  # the one before it
    out, err = capfd.readouterr()
    assert "skipping snapshot step-000000006" in err and "has no checksum" in err and "step-000000004" in out, err


def test_a_resume_checks_the_config_its_snapshot_holds_whatever_became_of_config_yaml(
    runs, tmp_path, monkeypatch, capfd
):
    run = tmp_path / "experiments" / "stop"
    shutil.copytree(runs["root"] / "experiments" / "stop-ddp", run)
    (run / "config.yaml").unlink()
    lr = json.loads((run / "checkpoints" / "step-000000006" / MARKER).read_text())["config"]["training"]["lr"]
    args = _args(runs["wl"], "stop", "ddp")
    monkeypatch.chdir(tmp_path)
    says = f"training.lr: {lr!r} -> 0.5"
    for config_yaml in (None, "training:\n  lr: 0.5\n"):  # gone; then edited to agree: the snapshot still disagrees
        if config_yaml:
            (run / "config.yaml").write_text(config_yaml)
        code, err = main(*args, "training.lr=0.5"), capfd.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("ddplab: error: ") and says in err, err[-2000:]
    assert main(*args) == 0, capfd.readouterr().err[-2000:]
    assert "resumed from" in capfd.readouterr().out
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["status"] == "complete" and summary["aggregates"]["resumes"] == 1
    assert summary["aggregates"]["steps"] == 16


def test_a_run_whose_newest_snapshot_has_another_format_resumes_from_the_one_before(runs, tmp_path, monkeypatch, capfd):
    run = tmp_path / "experiments" / "stop"
    shutil.copytree(runs["root"] / "experiments" / "stop-ddp", run)
    _edit(run / "checkpoints" / "step-000000006", lambda m: m.update(format=2))
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    code, out = main(*_args(runs["wl"], "stop", "ddp")), capfd.readouterr().out
    assert code == 0 and "skipping snapshot step-000000006: " in out and "a snapshot of format 2" in out, out[-2000:]
    assert "resumed from experiments/stop/checkpoints/step-" in out and "step-000000006" not in out.split("resumed")[1]
