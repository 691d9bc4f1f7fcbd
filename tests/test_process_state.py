"""Process-wide state: every change a run makes is undone when `ddplab.train()` returns, shown on the run's
first line, and the user's own variables win; the heartbeat never holds its lock over I/O, reports a failed
beat once, and ends its rank through the main thread."""

import gc
import json
import os
import signal
import sys
import threading
import time

import pytest
import torch

import ddplab
from ddplab.engine.diagnosis import heartbeat
from ddplab.engine.diagnosis.heartbeat import _BEATING, Heartbeat, PeerFailed
from ddplab.engine.parallel.distributed import Beat
from ddplab.engine.run_folder.folder import RunFolder
from ddplab.runtime import process_state

WORKLOAD = """
import torch
import ddplab
from torch.utils.data import TensorDataset


def data(cfg):
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
    return ddplab.Data(train=TensorDataset(x[:48], x[:48, :2]), val=TensorDataset(x[48:], x[48:, :2]),
                       task=ddplab.Regression(outputs=2))


def model(cfg, data):
    return torch.nn.Linear(3, 2)
"""
FAST = [
    "model.name=workload.py:model",
    "data.name=workload.py:data",
    "training.max_steps=2",
    "training.batch_size=8",
    "training.warmup_steps=0",
    "logging.trackers=[]",
    "logging.progress=false",
    "logging.plots=false",
]


def _process() -> dict:
    return {
        "matmul": torch.get_float32_matmul_precision(),
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "gc": (gc.isenabled(), gc.get_freeze_count()),
        "environ": dict(os.environ),
        "sys.path": list(sys.path),
        "SIGUSR2": signal.getsignal(signal.SIGUSR2),
        "in_effect": process_state.in_effect(),
    }


def test_train_twice_in_one_process_leaves_it_as_it_was(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "workload.py").write_text(WORKLOAD)
    import torch._dynamo  # noqa: F401 - torch's own import writes TORCHINDUCTOR_CACHE_DIR, once (AdamW imports it)

    before = _process()
    for name in ("a", "b"):
        summary = ddplab.train(None, [*FAST, f"experiment.name={name}"])
        assert summary["status"] == "complete"
        assert _process() == before
    first = (tmp_path / "experiments" / "a" / "train.log").read_text().splitlines()[0]
    assert "objects frozen" in first and f"sys.path + {tmp_path}" in first, first  # the start line shows them


def _children() -> set[int]:
    return {
        int(pid)
        for task in os.listdir("/proc/self/task")
        for pid in open(f"/proc/self/task/{task}/children").read().split()
    }


@pytest.mark.multiproc  # its loader workers are processes
def test_train_returns_with_no_loader_worker_left(tmp_path, monkeypatch):
    """Persistent workers (training and evaluation loaders) are stopped by the run, not left to the garbage
    collector: before, the user's process kept all of them after `ddplab.train()` returned."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "workload.py").write_text(WORKLOAD)
    before = _children()
    summary = ddplab.train(None, [*FAST, "data.num_workers=2", "experiment.name=w"])
    assert summary["status"] == "complete" and summary["epochs"][0]["val_loss"] > 0
    assert "2 data workers per process" in (tmp_path / "experiments" / "w" / "train.log").read_text()
    assert _children() - before == set()


def test_each_change_is_undone_last_first_and_a_users_variable_wins(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the flags are only read on a GPU; set here
    before, already = _process(), process_state.in_effect()  # another test in this process may have left some
    with process_state.changes():
        assert not process_state.env_default("MASTER_PORT", "29500")
        assert process_state.env_default(("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), "2000")
        process_state.tf32(True)
        process_state.import_path("/nowhere")
        assert torch.get_float32_matmul_precision() == "high" and sys.path[0] == "/nowhere"
        assert os.environ["MASTER_PORT"] == "1234" and os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
        assert process_state.in_effect()[len(already) :] == [
            "TORCH_FR_BUFFER_SIZE=TORCH_NCCL_TRACE_BUFFER_SIZE=2000",
            "TF32 matmuls on (training.tf32)",
            "sys.path + /nowhere",
        ]
        with process_state.changes():
            process_state.tf32(False)
            assert torch.backends.cudnn.allow_tf32 is False
        assert torch.backends.cudnn.allow_tf32 is True  # the inner block's change, undone at its end
    assert _process() == before


def test_a_frozen_generation_the_user_made_is_left_alone():
    gc.freeze()
    try:
        frozen, already = gc.get_freeze_count(), process_state.in_effect()
        with process_state.changes():
            process_state.freeze_gc()
            assert process_state.in_effect() == already  # nothing recorded: the user's frozen objects stay
        # Neither thawed (0) nor frozen again (more): a frozen object that died meanwhile leaves the count lower.
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_wandb_writes_under_the_users_wandb_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "workload.py").write_text(WORKLOAD)
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "mine"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "mine").mkdir()
    try:
        summary = ddplab.train(None, [*FAST, "logging.trackers=[wandb]", "experiment.name=w"])
    finally:
        import wandb

        wandb.teardown()  # the W&B service this worker started, and WANDB_SERVICE, end with the test
    assert summary["status"] == "complete"
    assert list((tmp_path / "mine" / "wandb").glob("offline-run-*"))
    assert not (tmp_path / "experiments" / "w" / "wandb").exists()


# ---------------------------------------------------------------------------- the heartbeat


class Ctx:
    """Rank `rank` of two, as the heartbeat sees it (its store is given to it by the test)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank, self.world_size, self.is_main, self.is_distributed = rank, 2, rank == 0, False
        self.beat = Beat()


class Store:
    """A c10d store whose every call is slow, noting whether the heartbeat's lock was held during it."""

    def __init__(self, failed: int = 0, delay: float = 0.0) -> None:
        self.data, self.locked, self.delay, self.calling = {"ddplab/failed": failed}, [], delay, threading.Event()
        self.gone = False  # its host (rank 0, or the agent) has exited
        if failed:
            self.data["ddplab/failed/1"] = json.dumps({"error": "RuntimeError: boom", "where": None, "beat": None})
            self.data["ddplab/done"] = 1  # the failed rank has read the report

    def _call(self) -> None:
        if self.gone:
            raise RuntimeError("Connection reset by peer")
        self.locked.append(_BEATING.locked())
        self.calling.set()
        time.sleep(self.delay)

    def set(self, key, value):
        self._call()
        self.data[key] = value

    def get(self, key):
        self._call()
        return self.data[key]

    def check(self, keys):
        self._call()
        return all(k in self.data for k in keys)

    def add(self, key, n):
        self._call()
        self.data[key] = self.data.get(key, 0) + n
        return self.data[key]

    def wait(self, keys, timeout):
        self._call()


def _heartbeat(tmp_path, store, rank=0, announce=None) -> Heartbeat:
    beat = Heartbeat(Ctx(rank), RunFolder(tmp_path, rank == 0), 60.0, announce or (lambda report: None), interval=0.02)
    beat.store = store
    return beat


def test_the_lock_is_not_held_during_a_store_call_and_a_fork_does_not_wait_for_one(tmp_path):
    store = Store(delay=0.5)
    beat = _heartbeat(tmp_path, store)
    with process_state.changes():
        beat.start()
        assert store.calling.wait(5)
        began = time.monotonic()
        heartbeat._BEATING.acquire()  # what os.fork() runs first, here while the beat is in a 0.5 s store call
        waited = time.monotonic() - began
        heartbeat._BEATING.release()
        beat.stop()
    assert waited < 0.1, waited
    assert store.locked and not any(store.locked)


def test_a_beat_that_raises_is_reported_once_and_the_beats_go_on(tmp_path, monkeypatch):
    beat = _heartbeat(tmp_path, None)
    raised = []

    def warn(seen):
        raised.append(1)
        raise ValueError("disk full")

    monkeypatch.setattr(beat, "_warn", warn)
    beat.start()
    deadline = time.monotonic() + 10
    while len(raised) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    beat.stop()
    assert len(raised) >= 5  # the beats went on after the first failure
    log = (tmp_path / "train.log").read_text()
    assert log.count("heartbeat raised ValueError: disk full") == 1, log
    assert (tmp_path / "logs" / "rank0.log").read_text().count("Traceback (most recent call last)") == 1


@pytest.mark.parametrize("rank", [0, 1])
def test_another_ranks_failure_ends_this_rank_through_its_main_thread(tmp_path, monkeypatch, rank):
    """Rank 0 writes the report; every rank's main thread ends, or faulthandler ends the process after a grace,
    rank 0's long enough to end its trackers' runs, the others' short (they have nothing left to write)."""
    exits, deadlines, reports = [], [], []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(heartbeat.faulthandler, "dump_traceback_later", lambda *a, **k: deadlines.append(a))
    monkeypatch.setattr(heartbeat.faulthandler, "cancel_dump_traceback_later", lambda: deadlines.append("cancelled"))
    handler = signal.getsignal(signal.SIGUSR2)
    store = Store(failed=1)
    if rank:
        store.data["ddplab/reported"] = "1"  # by rank 0
    beat = _heartbeat(tmp_path, store, rank, announce=reports.append)
    with pytest.raises(PeerFailed), process_state.changes():
        beat.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the main thread at work, in Python
            time.sleep(0.05)
    beat.stop()
    assert exits == [] and not beat._thread.is_alive()
    if rank == 0:
        assert reports and reports[0].startswith("job failed: rank 1 failed"), reports
    grace = heartbeat.GRACE_S if rank == 0 else heartbeat.OTHER_RANKS_GRACE_S
    assert deadlines == [(grace,), "cancelled"]  # the last resort, called off by the main thread
    assert signal.getsignal(signal.SIGUSR2) is handler
    assert "another rank failed" in (tmp_path / "logs" / f"rank{rank}.log").read_text()


def test_a_store_gone_with_its_host_ends_this_rank_through_its_main_thread(tmp_path, monkeypatch, capfd):
    """Rank 0 (or the agent) held the store and has exited: rank 1, stuck outside any collective (in Python here),
    would wait for ever; it ends as when a peer fails, its heartbeat's error said once."""
    monkeypatch.setattr(heartbeat.faulthandler, "dump_traceback_later", lambda *a, **k: None)
    monkeypatch.setattr(heartbeat.faulthandler, "cancel_dump_traceback_later", lambda: None)
    store = Store()
    beat = _heartbeat(tmp_path, store, rank=1)
    with pytest.raises(PeerFailed), process_state.changes():
        beat.start()
        assert store.calling.wait(5)  # beating through the store
        store.gone = True
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.05)
    beat.stop()
    err = capfd.readouterr().err
    assert err.count("heartbeat raised") == 1 and "this rank ends: the job's store is gone" in err, err
