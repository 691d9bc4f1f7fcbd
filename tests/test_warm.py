"""The suite's warm processes (tests/warm.py) stand in for fresh ones: what a process started warm prints, its
exit code, the signals it gets and its death when its stub is killed are those of `python ARGS`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm

SCRIPT = """
import os, signal, sys, time
from pathlib import Path
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("WARM_TEST"), flush=True)
print("torch imported before:", "torch" in sys.modules, file=sys.stderr)
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "raise":
    raise ValueError("boom")
if sys.argv[1] == "wait":
    signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(75)))
    Path("pid").write_text(str(os.getpid()))
    time.sleep(60)
"""

pytestmark = pytest.mark.skipif(not warm.enabled(), reason="DDPLAB_TESTS_WARM=0: the suite runs cold")


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "script.py").write_text(SCRIPT)
    cmd = warm.command([sys.executable, str(tmp_path / "script.py"), *args])
    assert cmd[:4] == [sys.executable, "-S", "-E", str(warm.STUB)]
    env = {**os.environ, "WARM_TEST": "yes"}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_a_warm_process_has_its_stubs_arguments_folder_environment_and_exit_code(tmp_path):
    proc = _run(tmp_path, "exit", "3")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == f"argv ['exit', '3'] cwd {tmp_path} env yes\n"
    assert "torch imported before: True" in proc.stderr  # forked from the server, which imported it


def test_a_process_whose_hugging_face_settings_differ_from_the_servers_runs_cold(tmp_path):
    """transformers and huggingface_hub read their offline switch when imported, as the server did: a process
    that sets it otherwise gets a fresh interpreter, which reads its own."""
    (tmp_path / "script.py").write_text(SCRIPT)
    cmd = warm.command([sys.executable, str(tmp_path / "script.py"), "exit", "0"])
    offline = "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"
    env = {**os.environ, "WARM_TEST": "yes", "HF_HUB_OFFLINE": offline}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "torch imported before: False" in proc.stderr, proc.stderr


def test_an_uncaught_exception_prints_its_traceback_and_exits_1(tmp_path):
    proc = _run(tmp_path, "raise")
    assert proc.returncode == 1 and proc.stderr.rstrip().endswith("ValueError: boom"), proc.stderr


def test_signals_reach_the_warm_process_and_killing_its_stub_kills_it(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    cmd = warm.command([sys.executable, str(tmp_path / "script.py"), "wait"])
    for sig, code in ((signal.SIGTERM, 75), (signal.SIGKILL, -9)):
        (tmp_path / "pid").unlink(missing_ok=True)
        stub = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        forked = int((tmp_path / "pid").read_text())
        assert forked != stub.pid
        stub.send_signal(sig)
        out, _ = stub.communicate(timeout=30)
        assert stub.returncode == code, out
        if sig == signal.SIGTERM:
            assert out.endswith("got SIGTERM\n")
        deadline = time.monotonic() + 10  # the server kills the process its killed stub stood for
        while Path(f"/proc/{forked}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{forked}").exists()


def test_a_jobs_processes_are_found_across_stubs_by_its_tag(tmp_path):
    """A warm process's environment in /proc is the server's: `tagged` finds it (and what it forks) through its
    stub, which carries the tag; `stands_for` and `children` see through the stub."""
    (tmp_path / "script.py").write_text(
        SCRIPT.replace('sys.argv[1] == "wait":', 'sys.argv[1] == "wait":\n    os.fork()')
    )
    cmd = warm.command([sys.executable, str(tmp_path / "script.py"), "wait"])
    stub = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, warm.TAG: "t1"}, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # written after the fork
        forked = warm.stands_for(stub.pid)
        assert forked not in (stub.pid, None) and warm.stands_for(forked) == forked
        [child] = warm.children(stub.pid)
        assert warm.tagged("t1") == sorted([stub.pid, forked, child]) and warm.tagged("t2") == []
    finally:
        for pid in warm.tagged("t1"):
            os.kill(pid, signal.SIGKILL)
        stub.wait()
