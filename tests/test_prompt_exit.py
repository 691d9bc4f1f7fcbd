"""A finished run exits promptly: its loader workers stopped together, and no interpreter teardown after the
run is recorded (issue: a 1-process run with 15 persistent, pinned loader workers took 85 s to exit after 11 s
of phases)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from conftest import TINY_GPT, _env


def test_a_finished_run_with_8_persistent_loader_workers_exits_within_2_s_of_its_training_end(tmp_path, corpus):
    """From the end of training (the last step, its snapshot and evaluation: the phases' `training` mark) to the
    process's exit: the run's end (end_of_run, teardown: the workers stopped) and the exit after its last line."""
    cmd = [sys.executable, "-m", "ddplab", "train", f"data.path={corpus}", *TINY_GPT, "experiment.name=x"]
    cmd += ["data.num_workers=8", "data.pin_memory=true", "training.max_steps=12", "logging.log_every=4"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    exited = time.time()
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "experiments" / "x"
    log = run / "train.log"
    assert "8 data workers per process" in log.read_text()
    phases = json.loads((run / "metrics.json").read_text())["phases"]
    last_line = log.stat().st_mtime  # the phases line, written once the teardown is measured
    trained = last_line - phases["teardown_s"] - phases["end_of_run_s"]
    assert exited - trained <= 2.0, (
        f"{exited - trained:.2f} s from the end of training to exit: end of run {phases['end_of_run_s']} s, "
        f"teardown {phases['teardown_s']} s, exit {exited - last_line:.2f} s after the last line"
    )
