"""Fault-tolerant replica groups (distributed.fault_tolerance=replicas, torchft): refused without torchft,
and a real 2-group gloo job in which one group is killed and comes back."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm

from conftest import TINY_GPT, _env, main
from ddplab.engine.snapshots.read import load_snapshot
from ddplab.engine.snapshots.write import Checkpointer

WORKLOAD = '''
import os, sys, time
from pathlib import Path
import torch
import ddplab
from torch.utils.data import TensorDataset


def data(cfg):
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        time.sleep(3)  # a restarted group is away longer than the Lighthouse's heartbeat timeout (2 s), however fast
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2112, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(2112, generator=g)
    return ddplab.Data(train=TensorDataset(x[:2048], y[:2048]), val=TensorDataset(x[2048:], y[2048:]),
                       task=ddplab.Regression())


class Gated(torch.nn.Sequential):
    """Slow (0.15 s a step) while the gate file exists: the healthy group is still training when the
    killed one is back, however long its restart takes on a loaded machine."""

    def __init__(self, gate):
        super().__init__(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.gate = gate

    def forward(self, x):
        if os.path.exists(self.gate):
            time.sleep(0.15)
        return super().forward(x)


def model(cfg, data):
    # This training process, for the test to find: a file named by its replica group and its pid.
    group = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("distributed.replica_group="))
    Path(cfg.options["gate"]).with_name(f"pid-group{group}-{os.getpid()}").touch()
    return Gated(cfg.options["gate"])
'''


def test_refused_without_torchft(monkeypatch, capfd):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    assert main("train", "distributed.fault_tolerance=replicas", "training.max_steps=1") == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "distributed.fault_tolerance=replicas" in err[0], err
    assert re.search(r": pip install 'torchft\S*' \(ddplab's ft extra\)$", err[0]), err


@pytest.mark.parametrize(
    ("args", "env", "words"),
    [
        ([], None, "distributed.fault_tolerance=replicas needs a torchft Lighthouse: set distributed.lighthouse="),
        (["distributed.lighthouse=not a url"], None, "distributed.lighthouse='not a url' is not a Lighthouse address"),
        (["distributed.lighthouse=http://localhost"], None, "'http://localhost' is not a Lighthouse address"),
        (["distributed.lighthouse=ftp://localhost:29510"], None, "'ftp://localhost:29510' is not a Lighthouse"),
        (["distributed.lighthouse=http://localhost:99999"], None, "'http://localhost:99999' is not a Lighthouse"),
        ([], "localhost:29510", "TORCHFT_LIGHTHOUSE='localhost:29510' in the environment is not a Lighthouse address"),
    ],
)
def test_no_lighthouse_or_one_that_cannot_be_is_refused_before_a_run_folder(
    tmp_path, monkeypatch, capfd, args, env, words
):
    """torchft's client takes any text and waits distributed.timeout for it (a KeyError after the run folder where
    none was given): refused at once instead, in one line naming the setting."""
    pytest.importorskip("torchft", reason="needs torchft (pip install 'ddplab[ft]')")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    if env is not None:
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", env)
    start = time.monotonic()
    assert main("train", "distributed.fault_tolerance=replicas", "training.max_steps=1", *args) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert time.monotonic() - start < 10 and not (tmp_path / "experiments").exists()


def _closed_port() -> int:
    """A port nobody listens on: bound, read and closed."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.serial  # bounds the job's wall time: run alone, after the parallel pass
def test_a_lighthouse_nobody_listens_on_fails_the_run_within_the_timeout_naming_it(
    corpus, tmp_path, monkeypatch, capfd
):
    pytest.importorskip("torchft", reason="needs torchft (pip install 'ddplab[ft]')")
    from ddplab.engine.parallel import replicas

    monkeypatch.chdir(tmp_path)
    address, timeout = f"http://localhost:{_closed_port()}", 4
    connecting = []  # when the manager began to connect: the model and data built before it take long on a busy host

    real = replicas.Manager

    def manager(*args, **kwargs):
        connecting.append(time.monotonic())
        return real(*args, **kwargs)

    monkeypatch.setattr(replicas, "Manager", manager)
    code = main(
        "train",
        "distributed.fault_tolerance=replicas",
        f"distributed.lighthouse={address}",
        f"distributed.timeout={timeout}",
        f"data.path={corpus}",
        *TINY_GPT,
        "training.max_steps=2",
        "experiment.name=lost",
    )
    took = time.monotonic() - connecting[0]
    run = tmp_path / "experiments" / "lost-group0"
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("ddplab")]
    assert code == 1 and len(err) == 1, err
    assert f"the torchft Lighthouse at {address} (distributed.lighthouse) did not answer within {timeout} s" in err[0]
    assert "rank" not in err[0], err[0]
    failure = json.loads((run / "metrics.json").read_text())
    assert failure["status"] == "failed" and address in failure["failure"]["summary"], failure
    assert failure["failure"]["culprit"]["rank"] is None and "rank" not in failure["failure"]["summary"]
    assert took < timeout + 10, f"{took:.1f} s"


@pytest.mark.serial  # bounds the job's wall time: run alone, after the parallel pass
def test_a_lighthouse_that_closes_mid_run_fails_the_job_naming_it_and_no_rank(corpus, tmp_path):
    """The report blamed "rank 1 stalled", or a rank's TimeoutError: the step's quorum fails with the Lighthouse
    gone, and the job ends within the timeout (+ 10 s) with one line naming it."""
    pytest.importorskip("torchft", reason="needs torchft (pip install 'ddplab[ft]')")
    from ddplab.commands.launch import LIGHTHOUSE

    port, timeout = _closed_port(), 5
    program = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) or "torchft_lighthouse"
    options = [f"--{name}={value}" for name, value in LIGHTHOUSE.items()]
    house = subprocess.Popen([program, f"--bind=[::]:{port}", *options], stderr=subprocess.DEVNULL)
    address, run = f"http://localhost:{port}", tmp_path / "experiments" / "closed-group0"
    job = subprocess.Popen(
        warm.command(
            [
                *(sys.executable, "-m", "ddplab", "train", "--nproc-per-node", "2"),
                *("distributed.fault_tolerance=replicas", f"distributed.lighthouse={address}"),
                *(f"distributed.timeout={timeout}", f"data.path={corpus}", *TINY_GPT, "generate.max_new_tokens=0"),
                *("training.epochs=1000", "logging.log_every=1", "experiment.name=closed"),
            ]
        ),
        cwd=tmp_path,
        env={**_env(), "RUST_LOG": "warn"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        log = run / "train.log"
        _wait(lambda: True if log.exists() and " step 5: " in log.read_text() else None, 240, job)
        house.kill()
        closed = time.monotonic()
        err = job.communicate(timeout=timeout + 120)[1]
        took = time.monotonic() - closed
    finally:
        house.kill()
        house.wait()
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    ours = [line for line in err.splitlines() if line.startswith("ddplab")]
    assert job.returncode == 1 and len(ours) == 1, err[-3000:]
    assert f"the torchft Lighthouse at {address} (distributed.lighthouse) formed no quorum" in ours[0], ours
    assert "rank" not in ours[0], ours[0]
    failure = json.loads((run / "metrics.json").read_text())
    assert failure["status"] == "failed" and failure["failure"]["culprit"]["rank"] is None, failure["failure"]
    assert failure["failure"]["summary"].startswith(f"job failed: the torchft Lighthouse at {address}")
    assert took < timeout + 10, f"the job ended {took:.1f} s after the Lighthouse"


def _worker(folder: Path, group: int) -> int | None:
    """The pid of replica group `group`'s training process (the lowest, under FSDP), from the file each one
    writes (WORKLOAD's model function) while it is alive."""
    found = []
    for entry in folder.glob(f"pid-group{group}-*"):
        pid = entry.name.rpartition("-")[2]
        try:
            alive = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
        except OSError:
            alive = False
        if alive:
            found.append(int(pid))
    return min(found, default=None)


def _rows(run: Path) -> list[dict]:
    path = run / "replicas.csv"
    if not path.exists():
        return []
    with path.open() as f:
        return [row for row in csv.DictReader(f) if row.get("time")]


def _weights(run: Path) -> dict:
    ck = Checkpointer(run / "checkpoints", is_main=False)
    return load_snapshot(ck.latest())["model"]


def _wait(what, timeout: float, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := what()) is not None:
            return found
        assert proc.poll() is None, f"the job ended early (exit {proc.returncode})"
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s")


def _job(tmp_path: Path, name: str, steps: int, *extra: str, gate: Path | None = None) -> subprocess.Popen:
    """A 2-group replica job of WORKLOAD (slow while `gate` exists), in its own session (killable whole), started
    warm (tests/warm.py: the stub, killed, takes the launcher with it, and the launcher its agents and workers)."""
    return subprocess.Popen(
        warm.command(
            [
                sys.executable,
                "-m",
                "ddplab",
                "train",
                "--replica-groups",
                "2",
                "distributed.fault_tolerance=replicas",
                "model.name=wl.py:model",
                "data.name=wl.py:data",
                f"model.options.gate={gate or tmp_path / 'never'}",
                "training.batch_size=8",
                f"training.max_steps={steps}",
                "training.epochs=100",
                "training.warmup_steps=0",
                "logging.log_every=10",
                "logging.trackers=[]",
                "logging.progress=false",
                "distributed.timeout=60",
                f"experiment.name={name}",
                *extra,
            ]
        ),
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.parametrize("nproc, strategy", [(1, "ddp"), (2, "fsdp")])
def test_a_killed_group_rejoins_from_its_peer(tmp_path, nproc, strategy):
    """A group's worker SIGKILLed: the other group goes on alone, and the killed group, restarted by its agent
    (its surviving worker, under FSDP, ended by the agent), rejoins with its peer's live state."""
    pytest.importorskip("torchft", reason="needs torchft (ddplab's ft extra)")
    (tmp_path / "wl.py").write_text(WORKLOAD)
    gate = tmp_path / "slow"
    gate.touch()
    steps, kill_at = 600 // nproc, 30  # 128 / nproc steps an epoch: the run crosses epochs' ends after the rejoin
    proc = _job(
        tmp_path,
        "ft",
        steps,
        "--max-restarts",
        "1",
        "--nproc-per-node",
        str(nproc),
        f"distributed.strategy={strategy}",
        gate=gate,
    )
    runs = [tmp_path / "experiments" / f"ft-group{i}" for i in range(2)]
    try:
        _wait(lambda: True if len(_rows(runs[1])) >= kill_at else None, 120, proc)
        survivor = _worker(tmp_path, 0)
        os.kill(_worker(tmp_path, 1), signal.SIGKILL)
        killed_at = len(_rows(runs[1]))
        # Back: a row of the restarted group, at a step past the kill (its state came from the peer: no snapshot yet).
        back = _wait(
            lambda: next((r for r in _rows(runs[1])[killed_at:] if int(r["step"]) > killed_at), None), 120, proc
        )
        assert _worker(tmp_path, 0) == survivor, "the healthy group was restarted"
        gate.unlink()
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    healthy = [r for r in _rows(runs[0]) if r["committed"] == "1"]
    assert [int(r["step"]) for r in healthy] == list(range(1, steps + 1)), "the healthy group skipped or redid steps"
    alone = [int(r["step"]) for r in healthy if r["replicas"] == "1"]
    assert alone and min(alone) > kill_at - 2 and max(alone) < int(back["step"]), alone
    assert all(r["global_batch"] == str(8 * nproc) for r in healthy if r["replicas"] == "1")
    with (runs[0] / "metrics.csv").open() as f:
        epochs = list(csv.DictReader(f))
    assert epochs[0]["replicas"] == "1" and float(epochs[0]["global_batch"]) < 16 * nproc, epochs[0]
    for run in runs:
        assert json.loads((run / "metrics.json").read_text())["status"] == "complete"
    assert "rejoined from a peer's live state" in (runs[1] / "train.log").read_text()
    told = (runs[0] / "train.log").read_text()
    left, came = (re.search(rf"step (\d+): group 1 {what}; (\d) of 2", told) for what in ("left", "came back"))
    assert left and came, told[-2000:]
    assert (int(left[1]), left[2], int(came[1]), came[2]) == (min(alone), "1", max(alone) + 1, "2")
    assert {r["groups"] for r in healthy if r["replicas"] == "1"} == {"0"}
    mine, theirs = _weights(runs[0]), _weights(runs[1])
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), "the rejoined group's parameters differ"


def test_status_names_the_quorum(tmp_path):
    from ddplab.commands.train import _quorum

    rows = ["step,replicas,global_batch,committed,time,groups", "1,2,16,1,1.0,0 1", "2,2,16,0,2.0,0 1"]
    rows += ["2,1,8,1,3.0,0", "3,1,8,1,4.0,0"]
    (tmp_path / "replicas.csv").write_text("\n".join(rows) + "\n")
    assert _quorum(tmp_path) == "; 1 replica group(s) (groups 0) in the quorum since step 2"
    assert _quorum(tmp_path / "absent") == ""


def _same_run(run: Path, ref: Path, steps_per_epoch: int | None = None) -> None:
    """`run` ended as the uninterrupted `ref` did: weights, epoch rows (losses, replicas, global batch), status.
    An epoch in which `run`'s group rejoined from a peer's live state holds the peer's train-loss sum up to the
    rejoin (docs/fault-tolerance.md): its train loss is not compared (`steps_per_epoch` places the rejoins)."""
    mine, theirs = _weights(run), _weights(ref)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs), f"{run.name}: weights differ from {ref.name}'s"
    rows, ref_rows = (list(csv.DictReader((r / "metrics.csv").open())) for r in (run, ref))
    rejoined = re.findall(r"step (\d+): this group rejoined from a peer's live state", (run / "train.log").read_text())
    mixed = {str((int(step) - 1) // steps_per_epoch + 1) for step in rejoined} if steps_per_epoch else set()

    def columns(row: dict) -> list:
        keys = ("epoch", "step", "val_loss", "replicas", "global_batch")
        return [row[k] for k in keys] + [None if row["epoch"] in mixed else row["train_loss"]]

    assert [columns(r) for r in rows] == [columns(r) for r in ref_rows]
    assert json.loads((run / "metrics.json").read_text())["status"] == "complete"


def test_a_whole_replica_job_killed_or_preempted_resumes_from_its_snapshots_exactly(tmp_path):
    """The whole job (every group and the Lighthouse) SIGKILLed, the same command pre-empted by SIGTERM, then the
    same command again: each group resumes from its own last snapshot each time, and the job ends as an
    uninterrupted job did."""
    pytest.importorskip("torchft", reason="needs torchft (ddplab's ft extra)")
    (tmp_path / "wl.py").write_text(WORKLOAD)
    steps = 150  # 128 steps an epoch per group: the kill falls in epoch 1, the end in epoch 2
    _finish(_job(tmp_path, "whole", steps, "checkpoint.every=20"))
    runs = [tmp_path / "experiments" / f"cut-group{i}" for i in range(2)]
    for sig, rows in ((signal.SIGKILL, 50), (signal.SIGTERM, 30)):  # the second: 30 steps into the resumed job
        job, before = _job(tmp_path, "cut", steps, "checkpoint.every=20"), len(_rows(runs[1]))
        try:
            _wait(lambda rows=rows, before=before: True if len(_rows(runs[1])) >= before + rows else None, 180, job)
            (os.killpg if sig == signal.SIGKILL else os.kill)(job.pid, sig)
            out, _ = job.communicate(timeout=120)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.communicate()
        if sig == signal.SIGTERM:
            assert job.returncode == 75, out[-3000:]
            stopped = {Checkpointer(run / "checkpoints", is_main=False).latest().name for run in runs}
            assert len(stopped) == 1, f"the groups stopped at different steps: {stopped}"
        assert all(Checkpointer(run / "checkpoints", is_main=False).latest() for run in runs), "no snapshot"
    _finish(_job(tmp_path, "cut", steps, "checkpoint.every=20"))
    for i, run in enumerate(runs):
        assert (run / "train.log").read_text().count("resumed from") == 2
        # A group whose newest snapshot is older than its peer's (the kill cut its save) rejoins from the peer.
        _same_run(run, tmp_path / "experiments" / f"whole-group{i}", steps_per_epoch=128)


def test_a_time_budget_stops_every_group_at_the_same_step(tmp_path):
    """Each group's own clock passes the budget at its own moment; the flag rides the all-reduce across groups,
    so both stop (and snapshot) after the same step, and the schedule planned over the budget is planned on the
    groups' mean time spent, so that both hold the same learning rate and the same weights."""
    pytest.importorskip("torchft", reason="needs torchft (ddplab's ft extra)")
    (tmp_path / "wl.py").write_text(WORKLOAD)
    gate = tmp_path / "slow"
    gate.touch()  # 0.15 s a step: the budget ends the run after a few log intervals
    _finish(_job(tmp_path, "budget", 1000, "training.time_budget=3s", gate=gate))
    records = [json.loads((tmp_path / "experiments" / f"budget-group{i}" / "metrics.json").read_text()) for i in (0, 1)]
    assert [r["stop_reason"] for r in records] == ["time_budget"] * 2
    steps = [r["aggregates"]["steps"] for r in records]
    assert steps[0] == steps[1] and steps[0] % 10 == 0, steps  # a log interval: where stops are agreed
    mine, theirs = (_weights(tmp_path / "experiments" / f"budget-group{i}") for i in (0, 1))
    assert all(torch.equal(mine[k], theirs[k]) for k in mine), "the groups' weights differ"


def test_the_start_line_gives_the_global_batch_with_every_group_present():
    """Each step's own is in replicas.csv and metrics.csv: the start line does not pretend the planned one holds."""
    from types import SimpleNamespace

    from ddplab.config import batch_arithmetic
    from ddplab.metrics.callbacks import RunRecorder
    from ddplab.registry import load_config
    from ddplab.tasks import Classification

    lines: list[str] = []
    view = SimpleNamespace(
        run=SimpleNamespace(log=lines.append),
        batch=batch_arithmetic(32, 1, 2 * 3, 600),  # 2 processes x 3 groups: the shares
        dist=SimpleNamespace(launch=SimpleNamespace(launcher="torchrun", describe=lambda: "torchrun"), backend="gloo"),
        config=load_config(
            None,
            [
                "distributed.fault_tolerance=replicas",
                "distributed.replica_groups=3",
                "distributed.lighthouse=http://lighthouse:29510",
            ],
        ),
        world_size=2,
        device="cpu",
        lr=1e-3,
        data_workers=0,
        data=SimpleNamespace(task=Classification(2)),
        data_feed=None,
    )
    RunRecorder().on_train_start(view)
    assert (
        "global batch = 32 per process x 1 accumulation x 2 processes x 3 replica groups = 192 with every group "
        "present;" in lines[0]
    )


def test_a_resume_that_keeps_the_global_batch_says_it_is_planned_with_every_group():
    from types import SimpleNamespace

    from ddplab.engine.loop.resume import keep_batch
    from ddplab.engine.parallel.replicas import Replicas

    replicas = Replicas.__new__(Replicas)  # what the line reads of it only: no quorum, no torchft manager
    replicas.groups = 2
    lines: list[str] = []
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(training=SimpleNamespace(batch_size=16, grad_accum_steps=1)),
        shares=2 * 2,  # 2 processes x 2 groups
        ctx=SimpleNamespace(world_size=2),
        faults=replicas,
        run=SimpleNamespace(log=lines.append),
        feed=SimpleNamespace(size=640),
    )
    keep_batch(trainer, {"global_batch": 128})
    assert trainer.batch["grad_accum_steps"] == 2 and lines == [
        "training.grad_accum_steps 1 -> 2: the global batch stays 128 on 2 processes x 2 replica groups, "
        "with every group present"
    ]
