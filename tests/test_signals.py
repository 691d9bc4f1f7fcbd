"""Signals to real 2-process jobs: SIGTERM to `ddplab train --nproc-per-node 2`, `ddplab study`
or `ddplab verify` reaches the workers, which snapshot; the command exits 75 and the same
command then continues (a run ends as if never stopped); SIGKILL of the launcher or of the
torchrun agent leaves no worker behind; plain torchrun's requeue check (`ddplab status`)."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import warm

from conftest import _env, assert_ok, ddplab
from ddplab.engine.snapshots.read import load_snapshot
from ddplab.engine.snapshots.write import Checkpointer
from references import corpus as text
from references import launched_args, launched_gpt, launched_job

_job, _args = launched_job, launched_args  # 20 steps: a signal after step 2 meets a running job
tagged = warm.tagged  # every process of one job, cold or warm


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return text(tmp_path_factory.mktemp("corpus"), 40_000)


def start(cmd: list[str], cwd: Path, cold: bool = False) -> tuple[subprocess.Popen, str, Path]:
    """`cmd` started warm (tests/warm.py), or with `cold` as it is, its processes marked by a tag of their own."""
    tag = uuid.uuid4().hex
    out = cwd / f"{tag}.out"
    proc = subprocess.Popen(
        warm.command(cmd, cold),
        cwd=cwd,
        env=_env() | {warm.TAG: tag},
        stdout=open(out, "w"),
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, tag, out


def wait_for_step(proc: subprocess.Popen, out: Path, step: int = 2, timeout: float = 240, pattern: str = "") -> None:
    """Until `out` (with `pattern`: a file under `out` matching it) shows the step."""
    deadline = time.time() + timeout
    while not any(f"step {step}:" in f.read_text() for f in (out.glob(pattern) if pattern else [out])):
        assert proc.poll() is None, f"exit {proc.returncode}: {proc.stderr.read()[-2000:]}"
        assert time.time() < deadline, "the job never reached its first steps"
        time.sleep(0.1)


def wait_until_gone(tag: str, seconds: float) -> float:
    """Seconds until no process of the job is left; fails after `seconds`."""
    t0 = time.time()
    while tagged(tag):
        assert time.time() - t0 < seconds, f"processes left after {seconds} s: {tagged(tag)}"
        time.sleep(0.1)
    return time.time() - t0


def launcher(corpus: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ddplab", "train", "--nproc-per-node", "2", *_args(corpus, name, *extra)[1:]]


def _weights(run: Path) -> dict:
    ck = Checkpointer(run / "checkpoints", is_main=False)
    return load_snapshot(ck.latest())["model"]


def _summary(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


@pytest.mark.parametrize(
    ("sig", "code", "status"), [(signal.SIGTERM, 75, "preempted"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_stop_signal_to_the_launcher_snapshots_and_the_rerun_ends_as_if_never_stopped(
    tmp_path, corpus, sig, code, status
):
    """SIGTERM: pre-empted, exit 75; Ctrl-C (the launcher passes it on as SIGINT): interrupted, exit 130."""
    reference = launched_gpt()  # this job never stopped, trained once per session (test_ddp.py reads it too)
    proc, tag, out = start(launcher(corpus, "r"), tmp_path)
    wait_for_step(proc, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    assert wait_until_gone(tag, 10) < 10  # agent and both workers ended with it
    run = tmp_path / "experiments" / "r"
    summary = _summary(run)
    stopped = summary["aggregates"]["steps"]
    assert summary["status"] == status and 2 <= stopped < 20
    assert Checkpointer(run / "checkpoints", is_main=False).latest().name == f"step-{stopped:09d}"
    assert "Traceback" not in err and "SignalException" not in err

    again = ddplab(*launcher(corpus, "r")[3:], cwd=tmp_path)  # the same command continues
    assert_ok(again)
    done, ref = _summary(run), _summary(reference)
    assert done["status"] == "complete" and done["aggregates"]["resumes"] == 1
    assert [(r["step"], r["loss"]) for r in done["steps"]] == [(r["step"], r["loss"]) for r in ref["steps"]]
    mine, theirs = _weights(run), _weights(reference)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("victim", ["launcher", "agent"])
def test_sigkill_of_the_launcher_or_the_agent_leaves_no_worker(tmp_path, corpus, victim):
    # Cold: what is tested is what the kernel does when a parent dies (a warm process's parent is the server).
    proc, tag, out = start(launcher(corpus, victim, "training.epochs=100"), tmp_path, cold=True)
    try:
        wait_for_step(proc, out)
        assert len(tagged(tag)) >= 4  # launcher, agent, 2 workers
        agents = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        os.kill(proc.pid if victim == "launcher" else agents[0], signal.SIGKILL)
        assert wait_until_gone(tag, 10) < 10  # (a dead launcher is a zombie until reaped: no environment)
        proc.wait(timeout=30)
        if victim == "agent":
            assert proc.returncode == 128 + signal.SIGKILL  # the launcher says how its job ended
    finally:
        for pid in tagged(tag):  # never leave a job running on the test machine
            os.kill(pid, signal.SIGKILL)
        proc.communicate()


def test_plain_torchrun_requeue_recipe_reads_the_run_status(tmp_path, corpus):
    """torchrun's agent exits 1 on SIGTERM whatever its workers did; `ddplab status` says 75."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "ddplab",
        *_args(corpus, "t", "training.epochs=100"),
    ]
    proc, tag, out = start(cmd, tmp_path)
    wait_for_step(proc, out)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode != 75  # why the recipe cannot use torchrun's exit code
    assert wait_until_gone(tag, 10) < 10
    status = ddplab("status", "experiments/t", cwd=tmp_path)
    assert (status.returncode, status.stdout.strip()) == (75, "preempted")
    # The README's recipe, as a shell runs it.
    recipe = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m ddplab status experiments/t; [ $? -eq 75 ] && echo requeue"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert recipe.stdout.split() == ["preempted", "requeue"]


def _stop_at_step_2(cmd: list[str], cwd: Path, where: Path, pattern: str) -> tuple[subprocess.Popen, str]:
    """Start `cmd`, SIGTERM it once its workers logged step 2; its stderr. No process outlives it."""
    proc, tag, _ = start(cmd, cwd)
    try:
        wait_for_step(proc, where, pattern=pattern)
        assert len(tagged(tag)) >= 4  # the command, an agent, 2 workers
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert wait_until_gone(tag, 10) < 10
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)
    return proc, err


# 20 steps take 0.3 s: slowed to 2 s, so that a signal after step 2 meets the running job.
SLOW = "distributed.simulated_latency_ms=100"


def test_sigterm_to_a_study_reaches_its_workers_exits_75_and_the_same_command_continues(tmp_path, corpus):
    cmd = [sys.executable, "-m", "ddplab", "study", *_job(corpus), SLOW, "--nproc", "2", "--name", "s"]
    point = tmp_path / "experiments" / "s" / "n2"
    proc, err = _stop_at_step_2(cmd, tmp_path, point, "launcher.log")
    assert proc.returncode == 75, err[-3000:]
    assert "study pre-empted during point n2" in err and "Traceback" not in err
    summary = _summary(point)
    assert summary["status"] == "preempted" and 2 <= summary["aggregates"]["steps"] < 20  # the workers snapshotted

    again = subprocess.run(warm.command(cmd), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert_ok(again)
    done = _summary(point)
    assert done["status"] == "complete" and done["aggregates"]["resumes"] == 1 and done["aggregates"]["steps"] == 20


def test_sigterm_to_verify_reaches_its_workers_exits_75_and_the_same_command_continues(tmp_path, corpus):
    cmd = [sys.executable, "-m", "ddplab", "verify", "--nproc", "2", *_job(corpus), SLOW]
    proc, err = _stop_at_step_2(cmd, tmp_path, tmp_path / "experiments", "verify-*/verify.log")
    assert proc.returncode == 75, err[-3000:]
    assert "verify pre-empted" in err and "Traceback" not in err
    [work] = (tmp_path / "experiments").glob("verify-*")  # kept, for the same command to continue
    assert _summary(work / "ddp")["status"] == "preempted"

    again = subprocess.run(warm.command(cmd), cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert_ok(again)
    assert f"continuing the pre-empted runs in {work.relative_to(tmp_path)}" in again.stdout
    assert again.stdout.strip().splitlines()[-1] == "PASS" and "steps compared: 20" in again.stdout, again.stdout
    assert not work.exists()  # compared, then removed


@pytest.mark.parametrize(
    ("sig", "code", "status"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 75, "preempted")]
)
def test_a_stop_signal_to_one_worker_under_max_restarts_stops_the_job(tmp_path, corpus, sig, code, status):
    """Not a failure for torchrun to restart: the agent ends with the job, the same command continues. Ctrl-C
    (SIGINT) is an interruption (130), SIGTERM a pre-emption (75), whichever rank it reached."""
    proc, tag, out = start(
        [*launcher(corpus, "w", SLOW)[:6], "--max-restarts", "1", *_args(corpus, "w", SLOW)[1:]], tmp_path
    )
    try:
        wait_for_step(proc, out)
        [agent] = warm.children(proc.pid)
        workers = warm.children(agent)
        os.kill(workers[-1], sig)
        _, err = proc.communicate(timeout=120)
        assert wait_until_gone(tag, 10) < 10
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == code, err[-3000:]
    summary = _summary(tmp_path / "experiments" / "w")
    assert summary["status"] == status and summary["aggregates"]["resumes"] == 0, summary["status"]
    assert 2 <= summary["aggregates"]["steps"] < 20 and "Traceback" not in err


def test_a_worker_killed_under_max_restarts_is_restarted_and_the_job_ends_complete(tmp_path, corpus):
    """SIGKILL is a failure, not a stop: torchrun's agent restarts the workers, they resume, and the
    launcher exits 0. The survivor is sent SIGTERM at once, as the agent does when it restarts the workers,
    before the survivor has failed on its own (which a loaded machine makes likely): a stop that the ranks
    never agreed on (the dead rank cannot) must not end the job."""
    cmd = [
        *launcher(corpus, "k", SLOW, "checkpoint.every=2")[:6],
        "--max-restarts",
        "1",
        *_args(corpus, "k", SLOW, "checkpoint.every=2")[1:],
    ]
    proc, tag, out = start(cmd, tmp_path)
    try:
        wait_for_step(proc, out, step=4)
        [agent] = warm.children(proc.pid)
        workers = warm.children(agent)
        os.kill(workers[-1], signal.SIGKILL)
        os.kill(workers[0], signal.SIGTERM)
        _, err = proc.communicate(timeout=240)
    finally:
        for pid in tagged(tag):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    summary = _summary(tmp_path / "experiments" / "k")
    assert summary["status"] == "complete" and summary["aggregates"]["resumes"] == 1
    assert summary["aggregates"]["steps"] == 20


@pytest.mark.parametrize(("status", "code"), [("interrupted", 130), ("preempted", 75)])
def test_the_launcher_exits_as_the_workers_stop_was_recorded(tmp_path, status, code):
    """A Ctrl-C's snapshot (the workers' report) ends the job with 130 even where the agent, stopped after it,
    exited with a failure; a pre-emption's with 75; both when a worker's Ctrl-C met another's SIGTERM."""
    from ddplab.commands.launch import outcome

    (tmp_path / f"{status}-rank00001").write_text("")
    assert outcome(tmp_path, 1, stopped=True) == (code, None)
    (tmp_path / "preempted-rank00000").write_text("")
    assert outcome(tmp_path, 1, stopped=True) == (130 if status == "interrupted" else 75, None)
