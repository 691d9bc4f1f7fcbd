"""DataLoader workers and the job's stop signals (engine/loop/loaders.py): a signal sent to the whole process group
reaches the loader workers too; their rank decides, snapshots, and stops them."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import ddplab
from conftest import TINY_GPT
from ddplab.api import train
from ddplab.engine.loop.loaders import _worker_init
from ddplab.engine.parallel.torch_internals import stop_loader_workers


class GroupSignal(ddplab.Callback):
    """After step 3, `sig` to this process and to its loader workers at once, as `timeout`, `scancel` or the
    terminal's Ctrl-C sends it to a whole process group (the test's process group holds more than this job)."""

    def __init__(self, sig: signal.Signals) -> None:
        self.sig, self.workers = sig, 0

    def on_step_end(self, view) -> None:
        if view.step == 3:
            children = multiprocessing.active_children()  # the training and evaluation loaders' workers
            self.workers = len(children)
            for child in children:
                os.kill(child.pid, self.sig)
            os.kill(os.getpid(), self.sig)


def test_a_sigterm_to_the_whole_group_is_a_pre_emption_and_the_same_call_continues(corpus, tmp_path, monkeypatch):
    """Workers forked while the rank trains inherit its handlers of SIGUSR1 and SIGINT, but torch gives them its own
    of SIGTERM, which died of a SIGTERM from anyone but their rank (the test below covers all three)."""
    monkeypatch.chdir(tmp_path)
    overrides = [f"data.path={corpus}", *TINY_GPT, "data.num_workers=2", "training.max_steps=8"]
    overrides += ["logging.log_every=2", "generate.max_new_tokens=0", "experiment.name=g"]
    signalled = GroupSignal(signal.SIGTERM)
    stopped = train(None, overrides, callbacks=[signalled])
    assert signalled.workers == 2 and stopped["status"] == "preempted", stopped.get("failure")
    assert stopped["aggregates"]["steps"] == 4  # agreed at the next log interval, after step 4, and snapshotted
    done = train(None, overrides)
    assert done["status"] == "complete" and done["aggregates"]["resumes"] == 1 and done["aggregates"]["steps"] == 8
    assert json.loads((tmp_path / "experiments" / "g" / "metrics.json").read_text())["status"] == "complete"


class Stuck(torch.utils.data.Dataset):
    """A worker stuck in __getitem__ for good (a lock, a read that never returns), its PID in `pid_file`."""

    def __init__(self, pid_file: Path) -> None:
        self.pid_file = pid_file

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i):
        self.pid_file.write_text(str(os.getpid()))
        threading.Event().wait()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_worker_outlives_the_jobs_stop_signals_but_not_its_loaders_shutdown(tmp_path):
    """The group's signals leave a worker to its rank; the loader's own SIGTERM (torch's, for a worker that does not
    stop within 5 s of being told) still ends it."""
    pid_file = tmp_path / "worker.pid"
    loader = DataLoader(Stuck(pid_file), num_workers=1, persistent_workers=True, worker_init_fn=_worker_init)
    loader._iterator = loader._get_iterator()  # its worker starts, and takes the first index; nobody waits for it
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the loader worker never started"
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    try:
        for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM):  # a KeyboardInterrupt ends torch's worker loop
            os.kill(worker, sig)
            time.sleep(0.5)  # a default action is immediate, a handler's run within microseconds
            assert _alive(worker), f"a loader worker died of a {sig.name} sent to the job"
        stop_loader_workers(loader)  # tells it, waits 5 s, then sends SIGTERM
        for _ in range(100):
            if not _alive(worker):
                break
            time.sleep(0.05)
        assert not _alive(worker), "a loader worker outlived its loader's shutdown"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
