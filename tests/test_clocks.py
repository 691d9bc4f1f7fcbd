"""Clocks that tell the truth: an epoch's training, evaluation and snapshot times cover its whole wall time,
time spent in callbacks included; channels_last; the default data workers; compile costs once."""

import functools
import json
import time

import pytest
import torch
from torch.utils.data import TensorDataset

import ddplab
from conftest import OneRankCtx
from ddplab.config import Config, DistributedConfig
from ddplab.engine.loop.loaders import data_workers
from ddplab.engine.loop.setup import wants_channels_last
from ddplab.engine.parallel.clock import Stamps
from ddplab.engine.parallel.ddp_comm import attach_step_timer, epoch_comm_row, install_comm_hook
from ddplab.engine.snapshots.read import load_file

FAST = [
    "logging.trackers=[]",
    "logging.progress=false",
    "logging.plots=false",
    "training.batch_size=8",
    "training.warmup_steps=0",
    "experiment.seed=3",
]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):  # (B, 3, 8, 8) -> (B, 3)
        return self.head(self.conv(x).relu().mean(dim=(2, 3)))


def model(cfg, data):
    return Net()


def data(cfg):
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(100, 3, 8, 8, generator=g), torch.randint(0, 3, (100,), generator=g)
    val = TensorDataset(images[:20], labels[:20]) if cfg.options.get("val", True) else None
    return ddplab.Data(train=TensorDataset(images, labels), val=val, task=ddplab.Classification(3))


class Stopwatch(ddplab.Callback):
    """A continuous clock read at the hooks; sleeps at each log, as a slow logger or tracker would."""

    def __init__(self, sleep_s: float) -> None:
        self.sleep_s, self.starts, self.ends = sleep_s, [], []

    def on_train_start(self, view):
        self.ends.append(time.perf_counter())  # the first epoch's clock starts here

    def on_epoch_start(self, view):
        self.starts.append(time.perf_counter())

    def on_log(self, view, values):
        time.sleep(self.sleep_s)

    def on_epoch_end(self, view, row):
        self.ends.append(time.perf_counter())


def _train(tmp_path, *overrides, callbacks=()):
    return ddplab.train(
        None,
        [*FAST, f"experiment.output_dir={tmp_path}", "experiment.name=run", *overrides],
        model=model,
        data=data,
        callbacks=callbacks,
    )


@pytest.mark.serial  # within 3 % of the wall clock over a 0.4-s epoch: a busy machine's stalls are more
def test_time_spent_in_callbacks_is_counted_in_the_epoch(tmp_path):
    watch = Stopwatch(0.02)
    rows = _train(
        tmp_path,
        "data.options.val=false",
        "checkpoint.save_best=false",
        "logging.log_every=1",
        "training.epochs=2",
        callbacks=[watch],
    )["epochs"]
    for row, start, end in zip(rows, watch.starts, watch.ends[1:], strict=True):
        real = end - start  # the same steps, on a clock that never stops
        assert row["eval_time_s"] == 0  # and the snapshot after the previous row lies before on_epoch_start
        assert 0.97 <= row["epoch_time_s"] / real <= 1.03, (row["epoch_time_s"], real)
        assert row["samples_per_s"] == pytest.approx(100 / row["epoch_time_s"])


@pytest.mark.serial  # the parts of the clock add up within 2 %: not beside another worker
def test_training_evaluation_and_snapshots_add_up_to_the_wall_clock(tmp_path):
    watch = Stopwatch(0.01)
    rows = _train(
        tmp_path,
        "checkpoint.every=4",
        "training.eval_every=5",
        "logging.log_every=2",
        "training.epochs=2",
        callbacks=[watch],
    )["epochs"]
    for row, begun, end in zip(rows, watch.ends, watch.ends[1:], strict=False):
        wall = end - begun  # from the previous row (or the start) to this one
        parts = row["epoch_time_s"] + row["eval_time_s"] + row["snapshot_time_s"]
        assert abs(parts - wall) / wall < 0.02, (row, wall)
        assert row["eval_time_s"] > 0 and row["snapshot_time_s"] > 0
    header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0]
    assert "snapshot_time_s" in header


def test_channels_last_trains_and_its_checkpoint_loads_into_a_plain_model(tmp_path):
    summary = _train(tmp_path, "training.channels_last=true", "training.epochs=1")
    assert summary["status"] == "complete" and summary["epochs"][0]["train_loss"] > 0
    weights = load_file(tmp_path / "run" / "checkpoints" / "best" / "state.pt")["model"]
    assert weights["conv.weight"].is_contiguous(memory_format=torch.channels_last)
    plain = Net()
    plain.load_state_dict(weights)
    assert plain.conv.weight.is_contiguous() and torch.equal(plain.conv.weight, weights["conv.weight"])
    x = torch.randn(2, 3, 8, 8)
    assert torch.allclose(plain(x), plain(x.contiguous(memory_format=torch.channels_last)), atol=1e-6)


def test_channels_last_auto_means_convolutions_on_cuda():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert wants_channels_last(Net(), "auto", cuda) and not wants_channels_last(Net(), "auto", cpu)
    assert not wants_channels_last(torch.nn.Linear(2, 2), "auto", cuda)
    assert wants_channels_last(torch.nn.Linear(2, 2), "true", cpu) and not wants_channels_last(Net(), "false", cuda)


def test_default_data_workers_come_from_the_cores_this_rank_may_use(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert data_workers(None, cuda, 1) == 15  # one core kept for the training process
    assert data_workers(None, cuda, 4) == 3
    assert data_workers(None, cuda, 32) == 0  # never more processes than cores
    assert data_workers(None, cpu, 1) == 0 and data_workers(6, cuda, 1) == 6
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)  # taskset -c 0-3
    assert data_workers(None, cuda, 2) == 1


def test_compile_costs_once_the_ragged_last_batch_included(tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    # aot_eager traces and guards as inductor does (forward and lazy backward) without generating C++: 2 s, not 40.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    graphs = []

    class Graphs(ddplab.Callback):
        def on_epoch_end(self, view, row):
            graphs.append(counters["stats"]["unique_graphs"])

    # 100 samples in batches of 8: each epoch ends with a batch of 4; evaluation runs uncompiled.
    summary = _train(tmp_path, "training.compile=true", "training.epochs=2", callbacks=[Graphs()])
    assert graphs == [1, 1]  # one graph for batches of 8 and of 4, in every epoch
    assert summary["phases"]["compile_s"] > 0
    phases = json.loads((tmp_path / "run" / "metrics.json").read_text())["phases"]
    assert phases["first_step_s"] < phases["compile_s"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_channels_last_is_automatic_and_the_times_still_add_up(tmp_path):
    watch = Stopwatch(0.01)
    rows = _train(tmp_path, "training.epochs=2", "checkpoint.every=4", callbacks=[watch])["epochs"]
    weights = load_file(tmp_path / "run" / "checkpoints" / "best" / "state.pt")["model"]
    assert weights["conv.weight"].is_contiguous(memory_format=torch.channels_last)
    for row, begun, end in zip(rows, watch.ends, watch.ends[1:], strict=False):
        parts = row["epoch_time_s"] + row["eval_time_s"] + row["snapshot_time_s"]
        assert abs(parts - (end - begun)) / (end - begun) < 0.02


def test_the_runs_last_snapshot_is_in_the_summary(tmp_path):
    watch, saved = Stopwatch(0.0), []

    class Snapshots(ddplab.Callback):
        def on_snapshot(self, view, path):
            saved.append(time.perf_counter())

    called = time.perf_counter()
    summary = _train(tmp_path, "training.epochs=2", "checkpoint.save_best=false", callbacks=[watch, Snapshots()])
    rows, run = summary["epochs"], summary["aggregates"]
    last = run["snapshot_time_s"] - sum(r["snapshot_time_s"] for r in rows)  # the one after the last row
    assert 0 < last <= saved[-1] - watch.ends[-1]
    in_rows = sum(r["epoch_time_s"] + r["eval_time_s"] + r["snapshot_time_s"] for r in rows)
    # train_time_s runs to that snapshot's start (what a resumed run goes on from): with it, the whole run.
    assert run["train_time_s"] + last - in_rows >= saved[-1] - watch.ends[-1]
    # The clock starts as the callbacks' on_train_start begin (ddplab's own column makers run before this
    # one's): never before the call, never past the last snapshot.
    assert run["train_time_s"] + last <= saved[-1] - called
    assert (
        json.loads((tmp_path / "run" / "metrics.json").read_text())["aggregates"]["snapshot_time_s"]
        == run["snapshot_time_s"]
    )


class LateEvent:
    """A CUDA event as the step clock sees one: recorded now, complete once the 'device' has got there."""

    device_at = 0.0  # the moment the device has reached

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def query(self):
        return self.at is not None and self.at <= LateEvent.device_at

    def elapsed_time(self, end):
        assert self.query() and end.query(), "an event read before it completed: that would sync"
        return (end.at - self.at) * 1000


def test_device_times_are_read_once_complete_never_by_a_sync(one_rank_group, monkeypatch):
    from torch.nn.parallel import DistributedDataParallel as DDP

    monkeypatch.setattr(torch.cuda, "Event", LateEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("a sync in the step clock"))
    LateEvent.device_at = 0.0
    raw = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4))
    model = DDP(raw, bucket_cap_mb=0.001)  # two buckets
    monitor = install_comm_hook(model, DistributedConfig(), OneRankCtx())
    timer = attach_step_timer(raw, monitor, Config())
    monitor.clock = timer.clock = Stamps(torch.device("cuda"))
    for _ in range(3):
        model(torch.randn(8, 32)).square().mean().backward()
    early = epoch_comm_row(monitor, OneRankCtx(), 1.0, timer)  # the device has not finished any step
    assert early["timed_micro_steps"] == 0 and early["forward_time_s"] == 0 and early["comm_time_s"] == 0
    LateEvent.device_at = float("inf")
    row = epoch_comm_row(monitor, OneRankCtx(), 1.0, timer)  # the same steps, read at the next epoch's end
    assert row["timed_micro_steps"] == 3 and row["forward_time_s"] > 0 and row["backward_time_s"] > 0
    assert row["comm_time_s"] > 0 and row["comm_exposed_s"] >= 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_forward_backward_and_all_reduce_are_the_devices_time(tmp_path, monkeypatch):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ctx = OneRankCtx()
        ctx.device = torch.device("cuda", 0)
        raw = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).cuda()
        model = DDP(raw, bucket_cap_mb=8)
        monitor = install_comm_hook(model, DistributedConfig(bucket_cap_mb=8), ctx)
        timer = attach_step_timer(raw, monitor, Config())
        x = torch.randn(4096, 2048, device="cuda")
        model(x).square().mean().backward()  # cuBLAS and NCCL warm up
        torch.cuda.synchronize()
        timer.take_epoch(), monitor.take_epoch()
        begun = time.perf_counter()
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("a sync per step"))
            for _ in range(5):
                model(x).square().mean().backward()
        torch.cuda.synchronize()
        wall = time.perf_counter() - begun
        row = epoch_comm_row(monitor, ctx, wall, timer)
        # The host only queues these matmuls (well under a tenth of the wall time); the device runs them.
        assert row["timed_micro_steps"] == 5
        assert 0.6 * wall <= row["forward_time_s"] + row["backward_time_s"] <= 1.02 * wall, (row, wall)
        assert row["backward_time_s"] > 1.3 * row["forward_time_s"]  # twice the matmuls
        assert 0 < row["comm_time_s"] < wall
    finally:
        dist.destroy_process_group()


def test_fsdp_collectives_count_the_union_of_their_intervals_in_training_only():
    from types import SimpleNamespace

    from ddplab.engine.parallel.fsdp_comm import ShardedCommMonitor

    beat = SimpleNamespace(phase="forward", collective=None, waiting=False)
    monitor = ShardedCommMonitor(torch.device("cpu"), beat)
    monitor._open = [[0.0, 1.0], [0.5, 2.0], [5.0, None]]  # two overlapping gathers; a third still in flight
    assert monitor.comm_s == 2.0 and len(monitor._open) == 1
    monitor._open[0][1] = 5.5
    monitor._open.append([1.5, 3.0])  # began before the counted 2.0 ends: adds only what lies past it
    assert monitor.comm_s == pytest.approx(3.5)
    beat.phase = "evaluation"  # evaluation's gathers are not training's communication
    monitor.end(monitor.begin("all_gather"))
    assert monitor.take_epoch() == {"comm_time_s": pytest.approx(3.5), "simulated_delay_s": 0.0, "comm_buckets": 0}
    beat.phase = "backward"
    interval = monitor.begin("reduce_scatter")
    assert beat.waiting and beat.collective == "FSDP reduce_scatter"
    time.sleep(0.01)
    monitor.end(interval)
    assert not beat.waiting and monitor.comm_s >= 0.01 and monitor.take_epoch()["comm_buckets"] == 1
