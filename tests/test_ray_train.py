"""ddplab.train() inside Ray Train (examples/ray_train.py): a local Ray with 2 CPU workers, rank 1 killed with
SIGKILL after step 5; Ray's FailureConfig restarts the worker group and the run ends exactly as the same job under
torchrun, never interrupted, ends (tests/references.py). About 100 s on this 2-core machine, most of it Ray
starting its processes (twice)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import torch

from conftest import ROOT, _env
from ddplab.engine.snapshots.read import load_snapshot
from ddplab.engine.snapshots.write import Checkpointer
from references import corpus, gpt_args, torchrun_gpt


def test_a_killed_ray_train_worker_is_restarted_and_the_run_ends_as_if_never_killed(tmp_path):
    reference = torchrun_gpt()
    _, *args = gpt_args(corpus(tmp_path, 20_000), "ray")  # without "train": the example's overrides
    cmd = [sys.executable, str(ROOT / "examples" / "ray_train.py"), "--workers", "2", "--kill-once", "1:5"]
    cmd += ["--storage", str(tmp_path / "ray_results"), *args, f"experiment.output_dir={tmp_path / 'experiments'}"]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]

    run = tmp_path / "experiments" / "ray"
    log = (run / "train.log").read_text()
    assert log.count("world size 2 (ray: rank 0 of 2, master ") == 2  # Ray's process group, in both attempts
    assert "resumed from " + str(run / "checkpoints" / "step-000000004") in log  # the last snapshot before step 5
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["status"] == "complete" and summary["aggregates"]["resumes"] == 1
    mine = load_snapshot(Checkpointer(run / "checkpoints", is_main=False).latest())["model"]
    ref = load_snapshot(Checkpointer(reference / "checkpoints", is_main=False).latest())["model"]
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    ref_steps = json.loads((reference / "metrics.json").read_text())["steps"]
    assert [(r["step"], r["loss"]) for r in summary["steps"]] == [(r["step"], r["loss"]) for r in ref_steps]

    # Ray holds every snapshot reported to it, the last being the run's last.
    reported = sorted(p.name for p in (tmp_path / "ray_results" / "ddplab").glob("ddplab-step-*"))
    assert reported[-1] == "ddplab-step-000000012" and "ddplab-step-000000004" in reported
    assert "ray: last checkpoint " + str(tmp_path / "ray_results" / "ddplab" / "ddplab-step-000000012") in out
