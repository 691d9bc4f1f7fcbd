"""Kills, crashes, hangs, NaNs and pre-emption in real 2-process gloo jobs (faults injected by
tests/faults.py, a script that trains as `ddplab train` does), checked against an unbroken run."""

import csv
import json
import math
import os
import re
import signal
import socket
import subprocess
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest
import torch
from torch.utils.data import DistributedSampler

import faults
from conftest import _env, assert_ok, main
from ddplab.engine.snapshots.read import load_snapshot
from ddplab.engine.snapshots.write import Checkpointer
from faults import command, ranks_command
from references import SAMPLES, corpus, gpt_args, torchrun_gpt

_args = gpt_args  # the shared reference's job, under another name


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return corpus(tmp_path_factory.mktemp("corpus"), 20_000)


@pytest.fixture(scope="module")
def reference() -> Path:
    """The same job, never interrupted (trained once per session: test_ddp.py reads it too)."""
    return torchrun_gpt()


def _weights(run: Path) -> dict:
    ck = Checkpointer(run / "checkpoints", is_main=False)
    return load_snapshot(ck.latest())["model"]


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in _summary(run)["steps"]]


def _summary(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def _same_as_reference(run: Path, reference: Path) -> None:
    mine, ref = _weights(run), _weights(reference)
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    assert _losses(run) == _losses(reference)  # every step's loss, bit for bit
    assert [r["epoch"] for r in csv.DictReader(open(run / "metrics.csv"))] == ["1", "2"]  # no duplicated rows


def _faulty(spec: str, args: list[str], cwd: Path, nproc: int | None = None, max_restarts: int = 0, **how):
    return subprocess.run(
        command(spec, args, nproc, max_restarts, **how),
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_sigkill_of_rank_1_under_max_restarts_ends_as_if_never_killed(tmp_path, data, reference):
    # the last snapshot is step 8, mid-epoch 2
    proc = _faulty("kill_rank=1,step=10", [*_args(data, "k"), "logging.trackers=[tensorboard]"], tmp_path, 2, 1)
    assert_ok(proc)
    run = tmp_path / "experiments" / "k"
    assert (run / "train.log").read_text().count("epoch 2 step 9:") == 2  # logged by the attempt that died, too
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 13))  # step 9 once
    assert "step-000000008 (epoch 2, step 8, 32 samples into the epoch" in (run / "train.log").read_text()
    _same_as_reference(run, reference)
    summary = _summary(run)
    assert summary["status"] == "complete" and summary["aggregates"]["resumes"] == 1


@pytest.mark.serial  # bounds the job's wall time
def test_sigkill_without_restarts_ends_the_job_naming_the_rank(tmp_path, data):
    """torchrun's agent, which saw rank 1's -9, stops rank 0 with SIGTERM: here always while rank 0 composes the
    report (under load it did so by chance), which is written whole all the same."""
    spec = "kill_rank=1,step=3,term_in_report=0"
    proc = _faulty(spec, _args(data, "dead"), tmp_path, 2, exec_workers=True)  # torchrun's summary
    ended = datetime.now()
    assert proc.returncode != 0
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*\n\s*exitcode\s*:\s*-9", proc.stderr), proc.stderr[-2000:]
    assert "ddplab: failed: rank 0: " in proc.stderr  # the survivor says why it stopped, and does not hang
    log = (tmp_path / "experiments" / "dead" / "train.log").read_text()
    steps = [line for line in log.splitlines() if re.search(r"epoch \d+ step \d+:", line)]
    assert "step 2:" in steps[-1]  # step 3's loss is reduced after rank 1 died: rank 0 fails there
    report = log[log.index("job failed:") :]
    assert report.startswith("job failed: rank 1 "), report  # the dead rank, not the survivor, heads the report
    assert "rank 0 " in report and "heartbeat.py" not in report
    summary = _summary(tmp_path / "experiments" / "dead")
    assert summary["status"] == "failed" and summary["failure"]["culprit"]["rank"] == 1, summary.get("failure")
    assert (ended - datetime.strptime(steps[-1][:19], "%Y-%m-%d %H:%M:%S")).total_seconds() < 60  # distributed.timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _srun_like(tmp_path: Path, args: list[str], fault: str) -> list[tuple[int, str, str, float]]:
    """Two workers started as srun would: rank variables set, no launcher watching them (forked from one process
    that imported torch, tests/faults.py --ranks); each one's exit code, stdout, stderr and the time it ended. A
    hang fails the test instead of the suite."""
    folder = tmp_path / "ranks"
    folder.mkdir(exist_ok=True)
    env = _env() | {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.Popen(ranks_command(2, folder, fault, args), cwd=tmp_path, env=env, start_new_session=True)
    try:
        proc.wait(timeout=270)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"the ranks' parent ended with {proc.returncode}"
    return faults.ended(folder, 2)


def test_an_exception_on_one_rank_ends_every_rank_without_a_launcher(tmp_path, data):
    (code0, _, err0, _), (code1, _, err1, _) = _srun_like(tmp_path, _args(data, "crash"), "raise_rank=1,step=3")
    assert code0 != 0 and code1 != 0
    assert "ddplab: failed: rank 1: RuntimeError: injected fault on rank 1 after step 3 at " in err1
    assert "job failed: rank 1 failed" in err0  # rank 0 heard of it through the heartbeat, and reported it


def test_a_hung_rank_fails_the_others_at_the_process_group_timeout(tmp_path, data):
    args = [*_args(data, "hang"), "distributed.timeout=5"]
    (code0, _, err0, ended0), (code1, _, _, ended1) = _srun_like(tmp_path, args, "hang_rank=1,step=3")
    assert code0 != 0 and "job failed: rank 1 stalled" in err0  # rank 0's report
    assert code1 != 0 and ended1 < ended0 + 30  # the stuck rank's heartbeat thread ended it, its stack dumped


def test_a_kill_between_snapshot_data_and_marker_resumes_from_the_previous_snapshot(tmp_path, data, reference):
    proc = _faulty("crash_before_marker=8", _args(data, "m"), tmp_path, 2, 1)  # complete before it: step 6 (and 4)
    assert_ok(proc)
    run = tmp_path / "experiments" / "m"
    log = (run / "train.log").read_text()
    assert "removed incomplete snapshot .tmp-step-000000008" in log
    assert "step-000000006 (epoch 2, step 6, 0 samples into the epoch" in log
    _same_as_reference(run, reference)


def _trace(trace: Path) -> dict[int, dict[int, list[int]]]:
    """epoch -> rank -> indices in the order trained."""
    seen: dict = {}
    for path in trace.glob("rank*.txt"):
        rank = int(path.stem[4:])
        for line in path.read_text().split("\n")[:-1]:
            epoch, index = map(int, line.split())
            seen.setdefault(epoch, {}).setdefault(rank, []).append(index)
    return seen


def test_stop_and_resume_mid_epoch_at_the_boundary_and_in_epoch_2_sees_every_sample_once(
    tmp_path, data, monkeypatch, capfd
):
    """Pre-empted (SIGUSR1, SIGTERM, SIGUSR1) after steps 3, 6 (end of epoch 1) and 9, then finished
    by ONE process."""
    trace = tmp_path / "trace"
    args = _args(data, "p")
    for step in (3, 6, 9):  # workers started as srun does; the signal reaches one rank only
        sig = "TERM" if step == 6 else "USR1"
        outs = _srun_like(tmp_path, args, f"trace={trace},signal_rank={step % 2},step={step},sig={sig}")
        assert [code for code, *_ in outs] == [75, 75], outs[0][2][-2000:]  # ExitCode.PREEMPTED, both ranks
        summary = _summary(tmp_path / "experiments" / "p")
        assert (summary["status"], summary["stop_reason"], summary["aggregates"]["steps"]) == (
            "preempted",
            "preempted",
            step,
        )
    monkeypatch.chdir(tmp_path)  # world size 2 -> 1: the rest of epoch 2 goes to one process, this one
    assert faults.main([f"trace={trace}", *args], monkeypatch.setattr) == 0, capfd.readouterr().err[-3000:]
    assert "world size changed from 2 to 1" in capfd.readouterr().out
    summary = _summary(tmp_path / "experiments" / "p")
    assert summary["status"] == "complete" and summary["aggregates"]["resumes"] == 3
    # The global batch is kept: one process accumulates 2 batches of 8, so the last 48 samples take 3 steps.
    assert summary["aggregates"]["epochs_completed"] == 2 and summary["aggregates"]["steps"] == 9 + 3

    seen = _trace(trace)
    assert sorted(seen) == [0, 1]
    for epoch, ranks in seen.items():
        everything = Counter(i for indices in ranks.values() for i in indices)
        assert sorted(everything) == list(range(SAMPLES)) and set(everything.values()) == {1}, epoch
    for rank in (0, 1):  # epoch 1, stopped twice, is exactly DistributedSampler's order
        expected = DistributedSampler(range(SAMPLES), 2, rank, seed=1337)
        expected.set_epoch(0)
        assert seen[0][rank] == list(expected)


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_nan_on_rank_1_only_is_seen_by_both_ranks(tmp_path, data, mode):
    args = [*_args(data, mode), f"training.nonfinite={mode}", "training.max_steps=7"]
    outs = _srun_like(tmp_path, args, "nan_rank=1,step=5")
    run = tmp_path / "experiments" / mode
    if mode == "stop":
        # each rank, the same step, one line, exit 1: a run-time failure
        for rank, (code, _, err, _) in enumerate(outs):
            assert code == 1 and err.strip().splitlines()[-1].startswith(
                f"ddplab: failed: rank {rank}: non-finite loss at step 5"
            ), err
        assert _summary(run)["status"] == "failed"
        assert "epoch 1 step 6:" not in (run / "train.log").read_text()
    else:
        assert [code for code, *_ in outs] == [0, 0], outs[0][2][-2000:]
        assert "step 5: non-finite loss on some rank; step skipped (training.nonfinite=skip)" in outs[0][1]
        summary = _summary(run)
        assert summary["ddp"]["ranks_identical"] and summary["aggregates"]["steps"] == 7
        steps = summary["steps"]  # the skipped step has no loss to report
        assert [r["step"] for r in steps] == [1, 2, 3, 4, 6, 7] and all(math.isfinite(r["loss"]) for r in steps)
        assert all(torch.isfinite(w).all() for w in _weights(run).values())


def test_time_budget_counts_time_spent_before_a_preemption(tmp_path, data, monkeypatch, capfd):
    args = [*_args(data, "tb"), "training.epochs=1000", "training.time_budget=2s", "checkpoint.every=null"]
    monkeypatch.chdir(tmp_path)  # one process: this one (a process adds nothing), pre-empted, then continued
    first = faults.main(["signal_rank=0,step=4", *args])
    assert first == 75, capfd.readouterr().err[-2000:]  # ExitCode.PREEMPTED: requeue me
    assert "stop signal (SIGUSR1) after step 4" in capfd.readouterr().out
    run = tmp_path / "experiments" / "tb"
    spent = _summary(run)["aggregates"]["train_time_s"]
    assert spent > 0 and _summary(run)["status"] == "preempted"

    assert main(*args) == 0, capfd.readouterr().err[-3000:]  # the same command again
    assert "resumed from" in capfd.readouterr().out
    summary = _summary(run)
    agg = summary["aggregates"]
    assert summary["stop_reason"] == "time_budget" and summary["status"] == "complete"
    assert agg["time_budget_s"] == 2 and agg["train_time_s"] >= 2 and agg["resumes"] == 1
    last = summary["epochs"][-1]  # evaluated at the stop (a part-epoch, unless it ended one)
    assert agg["steps"] > 4 and agg["epochs_completed"] == last["epoch"] - (1 if last.get("partial") else 0)
    assert last["step"] == agg["steps"] and last["val_loss"] > 0
    elapsed = [r["elapsed_s"] for r in summary["steps"]]
    assert elapsed == sorted(elapsed) and elapsed[4] >= spent  # the clock went on from the first attempt
    ck = Checkpointer(run / "checkpoints", is_main=False)
    assert ck.latest().name == f"step-{agg['steps']:09d}"  # snapshotted at the stop
