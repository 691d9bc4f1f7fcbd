"""Streams as PyTorch defines them (an IterableDataset shards itself, or not): found out, not refused; a stream
killed mid-epoch with loader workers resumed exactly; a stream's length checked, not trusted; what uneven ranks
leave untrained counted; a rerun over changed shards refused (tests/shards_workloads.py holds the workloads)."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from shards_workloads import write_tar_images

import ddplab
import faults
from conftest import _env, assert_ok, main
from conftest import ddplab as run_ddplab
from ddplab.engine.loop.data_identity import DataIdentity
from faults import command

HERE = Path(__file__).resolve().parent
WORK = HERE / "shards_workloads.py"
SAMPLES = 96


def _parquet_groups(path: Path, groups: int = 12, rows: int = 8) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"idx": list(range(groups * rows))}), path, row_group_size=rows)
    return path


def _data(tmp_path: Path, kind: str) -> Path:
    return write_tar_images(tmp_path / "tars") if kind == "tar" else _parquet_groups(tmp_path / "groups.parquet")


def _args(kind: str, data: Path, log: Path, name: str, *extra: str) -> list[str]:
    log.mkdir(exist_ok=True)
    return [
        "train",
        f"model.name={WORK}:recorder",
        f"data.name={WORK}:streams_data",
        f"data.options.kind={kind}",
        f"data.options.path={data}",
        f"model.options.log={log}",
        "training.epochs=2",
        "training.max_steps=1000",
        "training.batch_size=4",
        "training.warmup_steps=0",
        "logging.trackers=[]",
        "logging.progress=false",
        "logging.log_every=1",
        "distributed.timeout=60",
        f"experiment.name={name}",
        *extra,
    ]


def _batches(log: Path, keep: Path) -> dict[int, list[list[int]]]:
    """rank -> the idx of each training batch, in order, over every process of that rank (files moved to `keep`)."""
    keep.mkdir()
    out: dict[int, list[list[int]]] = {}
    for f in sorted(log.iterdir(), key=lambda f: (int(f.name.split(".")[0]), f.stat().st_mtime)):
        out.setdefault(int(f.name.split(".")[0]), []).extend(
            [int(i) for i in line.split()] for line in f.read_text().splitlines()
        )
        f.rename(keep / f.name)
    return out


def _metrics(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


# ---------------------------------------------------------------------------- streams as users bring them


# (kind, processes) -> (steps an epoch, checkpoint.every, the step a rank is killed at) of the kill test below
KILLED = {("tar", 3): (6, 3, 10), ("parquet", 2): (12, 5, 17)}


@dataclass
class Whole:
    """A job of the stream with 2 loader workers a rank, never interrupted: what it printed, its metrics.json
    and each rank's batches in order."""

    stdout: str
    metrics: dict
    batches: dict[int, list[list[int]]]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Callable[[str, int], Whole]:
    """whole(kind, nproc): the job trained once per module, whichever test asks first; the kill test's
    combinations with its snapshot interval (snapshots change no batch), read by both tests."""
    runs: dict[tuple[str, int], Whole] = {}

    def get(kind: str, nproc: int) -> Whole:
        if (kind, nproc) not in runs:
            cwd = tmp_path_factory.mktemp(f"whole-{kind}-{nproc}")
            every = [f"checkpoint.every={KILLED[kind, nproc][1]}"] if (kind, nproc) in KILLED else []
            args = _args(kind, _data(cwd, kind), cwd / "log", "whole", "data.num_workers=2", *every)
            proc = run_ddplab(args[0], "--nproc-per-node", str(nproc), *args[1:], cwd=cwd, timeout=300)
            assert_ok(proc)
            batches = _batches(cwd / "log", cwd / "seen")
            runs[kind, nproc] = Whole(proc.stdout, _metrics(cwd / "experiments" / "whole"), batches)
        return runs[kind, nproc]

    return get


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("kind", ["tar", "parquet"])
def test_a_stream_that_splits_itself_by_rank_and_worker_trains_as_brought(whole, kind, nproc):
    """No shards_itself attribute: its first items differ between ranks, and ddplab reads it as it is. Each
    epoch trains every sample at most once; what uneven ranks leave (tar at 3 processes: 36, 36 and 24
    samples) is counted in untrained_samples, on the epoch line too."""
    run = whole(kind, nproc)
    assert "the training stream shards itself" in run.stdout, run.stdout[-3000:]
    m, batches = run.metrics, run.batches
    steps = m["aggregates"]["steps"]
    assert sorted(batches) == list(range(nproc)) and all(len(b) == steps for b in batches.values())
    per_epoch = steps // 2
    for epoch, row in enumerate(m["epochs"]):
        seen = Counter(i for b in batches.values() for i in sum(b[epoch * per_epoch : (epoch + 1) * per_epoch], []))
        assert max(seen.values()) == 1 and set(seen) <= set(range(SAMPLES))
        assert row["read_samples"] == SAMPLES and row["untrained_samples"] == SAMPLES - len(seen)
    uneven = kind == "tar" and nproc == 3
    assert (m["epochs"][0]["untrained_samples"] > 0) == uneven
    assert ("untrained_samples 24" in run.stdout) == uneven
    assert m["epochs"][-1]["val_accuracy"] is not None


@pytest.mark.parametrize(("kind", "nproc"), list(KILLED))
def test_a_stream_that_splits_itself_killed_mid_epoch_with_workers_resumes_exactly(whole, tmp_path, kind, nproc):
    """With 2 loader workers a rank, a rank is SIGKILLed mid-epoch 2 (tar: 6 steps an epoch at 3 processes, the
    snapshot of step 9; parquet: 12 at 2, step 15: both an odd number of batches into the epoch, so the next
    batch is worker 1's). The rerun trains the uninterrupted run's steps, each rank the same batches in the
    same order. A copy of it resumed on 1 process says, and records, how many samples may be read twice or
    skipped."""
    per_epoch, every, kill = KILLED[kind, nproc]
    data, log = _data(tmp_path, kind), tmp_path / "log"
    extra = ("data.num_workers=2", f"checkpoint.every={every}")
    uninterrupted = whole(kind, nproc)

    args = _args(kind, data, log, "cut", *extra)
    cut = subprocess.run(
        command(f"kill_rank=1,step={kill}", args, nproc=nproc), cwd=tmp_path, env=_env(), capture_output=True, text=True
    )
    assert cut.returncode != 0
    snapshot = kill // every * every
    before = {r: b[:snapshot] for r, b in _batches(log, tmp_path / "cut").items()}
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "experiments" / "cut", elsewhere / "experiments" / "cut")
    resumed = run_ddplab(args[0], "--nproc-per-node", str(nproc), *args[1:], cwd=tmp_path)
    assert_ok(resumed)
    assert "skip forward past their own samples already trained" in resumed.stdout, resumed.stdout[-3000:]
    again = _batches(log, tmp_path / "again")
    assert {r: before[r] + again[r] for r in before} == uninterrupted.batches
    m = _metrics(tmp_path / "experiments" / "cut")
    assert m["aggregates"]["steps"] == uninterrupted.metrics["aggregates"]["steps"]
    assert not [note for note in m["data_notes"] if "resume_not_exact" in note]

    # the copy resumed on 1 process (this one): another split of the stream, said and recorded as not exact
    consumed = (snapshot - per_epoch) * 4 * nproc  # samples of epoch 2 trained before the snapshot
    with contextlib.chdir(elsewhere):
        assert main(*args) == 0
    (note,) = [
        n["resume_not_exact"]
        for n in _metrics(elsewhere / "experiments" / "cut")["data_notes"]
        if "resume_not_exact" in n
    ]
    assert note == {"epoch": 2, "may_repeat": consumed, "may_skip": consumed}


# ---------------------------------------------------------------------------- lengths checked, not trusted


def _in_process(tmp_path: Path, monkeypatch, *args: str) -> int:
    monkeypatch.chdir(tmp_path)
    try:
        return main(*args)
    except SystemExit as exit:
        return int(exit.code or 0)


def test_a_stream_whose_len_is_wrong_warns_and_the_schedule_and_eta_are_planned_again(tmp_path, monkeypatch, capfd):
    """Its __len__ says 44 (11 steps of 4); each epoch gives 96 (24 steps). Epoch 1 says so in one line and
    records both counts; the cosine schedule is planned again over 2 x 24 steps, so epoch 2's rate is still
    above its floor until the last step, and epoch 1's ETA counts epoch 2's 24 steps."""
    data = write_tar_images(tmp_path / "tars")
    args = _args("tar", data, tmp_path / "log", "wrong", "data.options.length=44")
    assert _in_process(tmp_path, monkeypatch, *args) == 0
    out = capfd.readouterr().out
    said = [line for line in out.splitlines() if "__len__ says 44" in line]
    assert len(said) == 1 and "the stream gave 96" in said[0] and "24 steps, not the 11 planned" in said[0], out
    assert "48 steps in all" in said[0]
    m = _metrics(tmp_path / "experiments" / "wrong")
    assert m["aggregates"]["steps"] == 48
    assert m["data_notes"] == [
        {
            "epoch": 1,
            "declared_samples": 44,
            "read_samples": 96,
            "untrained_samples": 0,
            "planned_steps": 11,
            "measured_steps": 24,
        }
    ]
    rates = {row["step"]: row["lr"] for row in m["steps"]}
    floor = rates[1] * 0.1
    assert rates[36] > 2 * floor and rates[44] > floor  # planned over 11 x 2 steps, both would be at the floor
    assert m["epochs"][0]["eta_s"] > 0  # 22 steps planned, 24 done: the old plan's ETA was 0


def test_max_steps_with_a_stream_trains_to_that_step_unless_epochs_is_set(tmp_path, monkeypatch):
    data = write_tar_images(tmp_path / "tars")
    args = [a for a in _args("tar", data, tmp_path / "log", "steps") if not a.startswith("training.epochs")]
    args = [a.replace("training.max_steps=1000", "training.max_steps=60") for a in args]
    assert _in_process(tmp_path, monkeypatch, *args) == 0
    m = _metrics(tmp_path / "experiments" / "steps")
    assert m["aggregates"]["steps"] == 60 and m["stop_reason"] == "max_steps"  # 2.5 epochs of 24 steps

    args = [a.replace("steps", "two") if a.startswith("experiment.name") else a for a in args] + ["training.epochs=2"]
    assert _in_process(tmp_path, monkeypatch, *args) == 0
    assert _metrics(tmp_path / "experiments" / "two")["aggregates"]["steps"] == 48


# ---------------------------------------------------------------------------- the data a snapshot was trained on


def test_a_rerun_over_changed_shards_is_refused_in_one_line_unless_allowed(tmp_path, monkeypatch, capfd):
    """A run pre-empted mid-epoch (SIGTERM after step 10) whose tar shards lose one and see another shrink before
    the rerun: refused, naming both; with checkpoint.allow_changed_data=true it goes on, and says and records it."""
    data = write_tar_images(tmp_path / "tars")
    args = _args("tar", data, tmp_path / "log", "changed")
    monkeypatch.chdir(tmp_path)
    assert faults.main(["signal_rank=0,step=10,sig=TERM", *args], monkeypatch.setattr) == ddplab.ExitCode.PREEMPTED
    (data / "003.tar").unlink()
    write_tar_images(tmp_path / "small", shards=1, per_shard=6)
    (tmp_path / "small" / "000.tar").replace(data / "005.tar")
    capfd.readouterr()

    assert _in_process(tmp_path, monkeypatch, *args) != 0
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the data changed since the snapshot step-000000010" in err[0], err
    assert "1 file(s) gone (003.tar)" in err[0] and "1 file(s) resized (005.tar" in err[0]
    assert "checkpoint.allow_changed_data=true" in err[0]
    assert _metrics(tmp_path / "experiments" / "changed")["aggregates"]["steps"] == 10

    assert _in_process(tmp_path, monkeypatch, *args, "checkpoint.allow_changed_data=true") == 0
    assert "going on with it (checkpoint.allow_changed_data=true)" in capfd.readouterr().out
    notes = _metrics(tmp_path / "experiments" / "changed")["data_notes"]
    assert notes[0]["step"] == 10 and "003.tar" in notes[0]["data_changed"]


def test_a_shards_data_set_that_shrank_is_told_from_its_shards_counts(tmp_path):
    class Alone:  # one process: gather_objects gives this rank's own
        world_size = 1

        @staticmethod
        def gather_objects(obj):
            return [obj]

    folder = _parquet_groups(tmp_path / "p" / "a.parquet").parent
    _parquet_groups(folder / "b.parquet")
    shards = ddplab.Shards(folder)
    saved = DataIdentity(ddplab.Data(train=shards, task=ddplab.Classification(2)), Alone()).state_dict()
    _parquet_groups(folder / "b.parquet", groups=2)
    now = DataIdentity(ddplab.Data(train=ddplab.Shards(folder), task=ddplab.Classification(2)), Alone())
    assert now.changes() == ""  # nothing loaded from a snapshot
    now.load_state_dict(saved)
    assert now.changes() == "Data.train: its length 192 -> 112, 1 file(s) resized (b.parquet 96 -> 16)"


# ---------------------------------------------------------------------------- what ddplab cannot tell


UNSEEDED = """
import torch
import ddplab


class Unseeded(torch.utils.data.IterableDataset):
    def __iter__(self):
        for _ in range(8):
            yield {"x": torch.randn(4), "labels": 0}


def data(cfg):
    return ddplab.Data(train=Unseeded(), task=ddplab.Classification(2))
"""


def test_a_stream_read_differently_each_time_is_refused_naming_shards_itself(tmp_path, monkeypatch, capfd):
    (tmp_path / "w.py").write_text(UNSEEDED)
    code = _in_process(
        tmp_path,
        monkeypatch,
        "train",
        f"data.name={tmp_path / 'w.py'}:data",
        f"model.name={WORK}:recorder",
        "model.options.log=.",
        "training.max_steps=2",
        "data.num_workers=2",
        "logging.trackers=[]",
    )
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "change from one read to the next" in err[0] and "shards_itself = True" in err[0]
    assert "tokenizer" not in err[0]
    assert not (tmp_path / "experiments").exists()
