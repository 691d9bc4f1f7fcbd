"""The benchmark contenders end cleanly with 2 gloo processes, every time: a DDP model or
optimizer still alive when the process group is destroyed aborts about one run in four at exit
("terminate called without an active exception", SIGABRT)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, _env

CONTENDERS = ROOT / "benchmarks" / "contenders"


def _run(script: str, out, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(CONTENDERS / script),
        "digits",
        "1",
        str(out),
        *extra,
    ]
    return subprocess.run(cmd, cwd=out.parent, env=_env(), capture_output=True, text=True, timeout=120)


def _assert_clean(proc: subprocess.CompletedProcess, out) -> None:
    assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stderr[-3000:]
    assert json.loads(out.read_text())["epoch_times"]


def test_the_handwritten_loop_ends_cleanly(tmp_path):
    # An abort showed in about one run in four. Each run is a plain torchrun of 2 exec'd workers (about 10 s of
    # CPU): one run catches that abort with probability 1/4 per suite run, and a regression shows within a few
    # suite runs, as for the interleaved loop below. Catching it in one sitting is the stress script's job:
    # scripts/teardown_stress.py --contender handwritten runs 30 (1 - (3/4)^30 > 99.9 %).
    out = tmp_path / "run.json"
    _assert_clean(_run("handwritten.py", out, "--max-steps", "2"), out)


def test_the_interleaved_loops_end_cleanly(tmp_path):
    out = tmp_path / "run.json"
    _assert_clean(_run("interleaved.py", out, "--max-steps", "2"), out)  # ddplab's epoch, then 2 hand steps


@pytest.mark.parametrize("script, library", [("accelerate_loop.py", "accelerate"), ("fabric_loop.py", "lightning")])
def test_the_library_loops_end_cleanly(tmp_path, script, library):
    pytest.importorskip(library, reason=f"{library} is not installed here")
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        _assert_clean(_run(script, out), out)
