"""Launchers that start one `ddplab train` per node and say only where the node sits: Kubeflow Trainer's torch
plugin (PET_*) and SkyPilot (SKYPILOT_*). Two such "nodes" on this machine (loopback), with exactly the
variables each launcher sets: they train, one is killed, both are started again as a JobSet or `sky jobs`
restarts them, and the run ends as the same job never interrupted (tests/references.py) ends."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm

from conftest import _env
from ddplab.engine.snapshots.read import load_snapshot
from ddplab.engine.snapshots.write import Checkpointer
from references import corpus, gpt_args, torchrun_gpt

# Each step's all-reduce waits this long (it only sleeps): a kill lands mid-run, whatever the machine's load.
SLOW = "distributed.simulated_latency_ms=150"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer(node: int, port: int) -> dict:
    """What Kubeflow Trainer's torch plugin sets on node `node` of 2 (1 process per node)."""
    return {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(node),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
    }


def skypilot(node: int, port: int) -> dict:
    """What SkyPilot sets on node `node` of 2 CPU nodes; the port is the task's own (MASTER_PORT)."""
    return {
        "SKYPILOT_NODE_RANK": str(node),
        "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NUM_GPUS_PER_NODE": "0",
        "MASTER_PORT": str(port),
    }


def _start(variables: dict, args: list[str], cwd: Path, name: str) -> subprocess.Popen:
    out = open(cwd / f"{name}.txt", "a")  # noqa: SIM115 - the process's; closed when it ends
    return subprocess.Popen(
        warm.command([sys.executable, "-m", "ddplab", *args]),  # killed whole: its stub, then what it stands for
        cwd=cwd,
        env=_env() | variables,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a node: killed whole
    )


def _nodes(launcher, args: list[str], cwd: Path, kill_at: str | None = None) -> list[int]:
    """Both nodes to their end (or, with `kill_at`, node 1 killed with SIGKILL once rank 0 has logged it); their
    exit codes."""
    port = _free_port()
    procs = [_start(launcher(node, port), args, cwd, f"node{node}") for node in (0, 1)]
    log = cwd / "experiments" / args[-1].split("=", 1)[1] / "train.log"
    try:
        deadline = time.monotonic() + 240
        while kill_at and time.monotonic() < deadline and procs[1].poll() is None:
            if log.is_file() and kill_at in log.read_text():
                os.killpg(procs[1].pid, signal.SIGKILL)
                break
            time.sleep(0.02)
        return [proc.wait(timeout=max(deadline - time.monotonic(), 1)) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _weights(run: Path) -> dict:
    return load_snapshot(Checkpointer(run / "checkpoints", is_main=False).latest())["model"]


def _losses(run: Path) -> list[tuple[int, float]]:
    import json

    return [(r["step"], r["loss"]) for r in json.loads((run / "metrics.json").read_text())["steps"]]


@pytest.mark.parametrize("launcher", [trainer, skypilot])
def test_two_nodes_one_killed_resume_as_if_never_killed(tmp_path, launcher):
    reference = torchrun_gpt()  # the same job: 2 processes under torchrun, never interrupted
    args = [*gpt_args(corpus(tmp_path, 20_000), "nodes"), SLOW]
    args.append(args.pop(args.index("experiment.name=nodes")))  # last: _nodes reads the run's name there
    first = _nodes(launcher, args, tmp_path, kill_at="epoch 1 step 5:")
    output = (tmp_path / "node0.txt").read_text()
    via = {trainer: "Kubeflow Trainer: PET_NNODES", skypilot: "SkyPilot: SKYPILOT_NODE_RANK"}[launcher]
    assert f"ddplab: node 0 of 2 ({via}" in output and "master 127.0.0.1:" in output
    assert first[0] != 0 and first[1] == -signal.SIGKILL, output[-3000:]  # node 0 saw its peer die and ended
    run = tmp_path / "experiments" / "nodes"
    assert (
        "world size 2 (torchrun under " + via.split(":")[0] + ": rank 0 of 2, master 127.0.0.1:"
        in (run / "train.log").read_text()
    )

    assert _nodes(launcher, args, tmp_path) == [0, 0], (tmp_path / "node0.txt").read_text()[-3000:]
    log = (run / "train.log").read_text()
    assert "resumed from experiments/nodes/checkpoints/step-" in log  # the second attempt continued a snapshot
    mine, ref = _weights(run), _weights(reference)
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    assert _losses(run) == _losses(reference)  # every step's loss, bit for bit


def test_a_missing_node_variable_is_one_line_and_exit_2_before_anything_is_written(tmp_path, monkeypatch, capfd):
    from conftest import main

    monkeypatch.chdir(tmp_path)
    for name, value in trainer(1, 29500).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PET_MASTER_ADDR")
    assert main("train", "training.max_steps=1") == 2
    err = capfd.readouterr().err.strip()
    assert (
        err == "ddplab: error: PET_NNODES is set but PET_MASTER_ADDR is not: the launcher's environment is incomplete"
    )
    assert not (tmp_path / "experiments").exists()


def test_env_prints_what_a_bug_report_needs(monkeypatch, capfd):
    import ddplab
    from conftest import main

    for name, value in skypilot(0, 29511).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SKYPILOT_API_SERVER_TOKEN", "secret")  # not SkyPilot's placement: not shown
    assert main("env") == 0
    out = capfd.readouterr().out
    assert out.startswith(f"ddplab {ddplab.__version__} (") and f"torch {torch.__version__}; CUDA " in out
    assert "devices: " in out and "extras: text (transformers " in out
    assert "launcher: ddplab train starts node 0 of 2 (SkyPilot: " in out and "master 127.0.0.1:29511" in out
    assert (
        "secret" not in out
        and "  SKYPILOT_NUM_NODES=2\n" in out
        and "  SKYPILOT_NODE_IPS='127.0.0.1\\n127.0.0.1'\n" in out
    )
    monkeypatch.setenv("SKYPILOT_NUM_NODES", "3")
    assert main("env") == 0  # a bad variable is reported, not fatal: the report is what is needed then
    assert "launcher: ddplab train would stop here: SKYPILOT_NODE_IPS holds 2 address(es)" in capfd.readouterr().out
