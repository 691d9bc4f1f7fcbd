"""Shared helpers: run the CLI as a user would, in fresh processes (or in this one, where a process adds nothing)."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import warm

from tiers import (  # noqa: F401 (hooks: the tiers)
    pytest_collection_modifyitems,
    pytest_runtest_call,
    pytest_runtest_logreport,
    pytest_terminal_summary,
)

ROOT = Path(__file__).resolve().parents[1]


SHARED = "DDPLAB_TESTS_SHARED"  # the folder of the runs trained once per test session


def pytest_configure(config):
    """The record of code trained with on this machine (workload.py) is the suite's own, not the user's; and
    the reference runs the tests share: one folder each for the whole run, made before xdist's workers start
    (they inherit them)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        # The suite's models and datasets are its own files: the Hugging Face libraries never ask the hub (and a
        # test that sets these itself, as a user offline would, still runs warm: tests/warm_stub.READ_AT_IMPORT).
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
            os.environ.setdefault(name, "1")
        os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="ddplab-tests-state-")
        os.environ[SHARED] = tempfile.mkdtemp(prefix="ddplab-tests-shared-")


def pytest_unconfigure(config):
    warm.stop()
    if "PYTEST_XDIST_WORKER" not in os.environ and SHARED in os.environ:
        shutil.rmtree(os.environ.pop(SHARED), ignore_errors=True)


def shared(name: str, make: Callable[[Path], object]) -> Path:
    """The folder `name`, made once per test session by `make(folder)`, whichever test and xdist worker asks
    first: the others wait on its lock and reuse it (one name, one job: tests/references.py). The folder is
    shared: a test that changes a run copies it first."""
    root = Path(os.environ[SHARED])
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


# A GPT small enough that a 2-process run takes seconds on one core each.
TINY_GPT = [
    "model.layers=1",
    "model.dim=32",
    "model.heads=2",
    "model.context=32",
    "training.batch_size=8",
    "logging.trackers=[]",
    "logging.progress=false",
    "generate.max_new_tokens=20",
]


def _env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def ddplab(
    *args: str, cwd: Path | None = None, timeout: float = 300, cold: bool = False
) -> subprocess.CompletedProcess:
    """`ddplab ARGS` in a process of its own: forked from a warm one that has imported torch (tests/warm.py), or
    with `cold` a fresh interpreter."""
    cmd = warm.command([sys.executable, "-m", "ddplab", *args], cold)
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def torchrun(
    nproc: int,
    *args: str,
    cwd: Path | None = None,
    timeout: float = 300,
    extra: tuple[str, ...] = (),
    forked: bool = False,
    cold: bool = False,
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node=N -m ddplab ARGS`; `forked`: its workers forked from it
    (tests/faults.py), where plain torchrun starts a Python of their own for each. Each process is forked from a
    warm one (tests/warm.py), or with `cold` a fresh interpreter."""
    from faults import forked_torchrun

    options = ["--standalone", f"--nproc-per-node={nproc}", *extra]
    if forked:
        cmd = forked_torchrun(options, ["-m", "ddplab", *args])
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", *options, "-m", "ddplab", *args]
    # Its own session: a job that outlives the timeout is killed whole, its workers too, not left running.
    proc = subprocess.Popen(
        warm.command(cmd, cold),
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def verify(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`ddplab verify ARGS` run from `cwd`, its exit code and what it printed, as ddplab() gives them: the command
    in this process (its own process would only import torch to wait), its two runs in processes of their own."""
    return _here("verify", *args, cwd=cwd)


def run_study(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`ddplab study ARGS` run from `cwd`, as verify(): the command in this process (its own would only start,
    wait for and report on its points), each point's job in processes of its own."""
    return _here("study", *args, cwd=cwd)


def _here(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warm.processes():
        code = main(*args)
    return subprocess.CompletedProcess(["ddplab", *args], code, out.getvalue(), err.getvalue())


def main(*args: str) -> int:
    """`ddplab ARGS` in this process, for bad input where a process adds nothing: its exit code (argparse's
    errors included); read what it printed with capfd."""
    from ddplab.cli import main as cli_main

    try:
        return cli_main(list(args))
    except SystemExit as exit:
        return exit.code


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A 60 KB slice of the embedded corpus as a user's text file."""
    from ddplab.workloads.char_lm import embedded_corpus

    path = tmp_path / "corpus.txt"
    path.write_text(embedded_corpus()[:60_000])
    return path


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group, for DDP and comm-hook tests inside the pytest process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    group = dist.group.WORLD
    yield
    # Hook callbacks run on the group's worker threads and may hold the test's DDP state (which
    # holds the group). Were a worker thread to drop the group's last reference, the group's
    # destructor would join that very thread and abort the whole pytest process. So: let the
    # callbacks finish, collect the test's objects here, and drop the group here, last.
    time.sleep(0.2)
    gc.collect()
    dist.destroy_process_group()
    del group
    gc.collect()


class OneRankCtx:
    """The DistContext surface the comm code uses, for one rank."""

    def __init__(self):
        import torch

        self.world_size, self.device = 1, torch.device("cpu")

    def all_reduce(self, tensor, op="sum"):
        return tensor


def image_tar(path: Path, samples: int = 8) -> Path:
    """A WebDataset tar shard of `samples` 12x10 PNGs of 2 classes (img<j>.png, img<j>.cls)."""
    import tarfile

    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for j in range(samples):
            png = io.BytesIO()
            Image.new("RGB", (12, 10), (200 * (j % 2), 30, 30)).save(png, format="PNG")
            for ext, blob in (("png", png.getvalue()), ("cls", str(j % 2).encode())):
                info = tarfile.TarInfo(f"img{j}.{ext}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    return path
