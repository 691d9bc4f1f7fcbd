"""Communication hooks: a simulated wide-area delay that composes with compression, and
measured communication time that rises by the delay it adds."""

import csv
import json

import pytest
import torch

from conftest import TINY_GPT, OneRankCtx, assert_ok, run_study
from ddplab.config import DistributedConfig
from ddplab.engine.parallel.ddp_comm import epoch_comm_row, install_comm_hook, link_delay_s


def test_link_delay_is_latency_plus_ring_transfer_time():
    assert link_delay_s(10**6, 2, 20.0, None) == pytest.approx(0.020)
    # A ring all-reduce sends 2 (N-1)/N of the payload: 1 MB with 4 ranks -> 1.5 MB = 12 Mbit at 100 Mbit/s.
    assert link_delay_s(10**6, 4, 0.0, 100.0) == pytest.approx(0.12)
    assert link_delay_s(10**6, 4, 5.0, 100.0) == pytest.approx(0.125)


@pytest.mark.parametrize("hook", ["none", "fp16", "bf16"])
def test_delay_composes_with_compression_and_is_timed(one_rank_group, hook):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)), bucket_cap_mb=0.01)
    model.module.load_state_dict(plain.state_dict())
    monitor = install_comm_hook(model, DistributedConfig(comm_hook=hook, simulated_latency_ms=15.0), OneRankCtx())
    x = torch.randn(16, 64)
    plain(x).square().mean().backward()
    model(x).square().mean().backward()
    row = epoch_comm_row(monitor, OneRankCtx(), epoch_time=10.0)
    assert row["comm_calls"] >= 1 and row["simulated_delay_s"] == pytest.approx(0.015 * row["comm_calls"])
    assert row["comm_time_s"] >= row["simulated_delay_s"] * 0.99 and row["compute_time_s"] == pytest.approx(
        10 - row["comm_time_s"]
    )
    tol = 1e-6 if hook == "none" else 1e-2  # one rank: the all-reduced gradient is the gradient, up to compression
    for a, b in zip(plain.parameters(), model.module.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=tol, atol=tol)


def test_one_process_spends_no_time_communicating():
    assert epoch_comm_row(None, OneRankCtx(), 3.0) == {"comm_time_s": 0.0, "compute_time_s": 3.0}


def test_simulated_latency_raises_measured_comm_time_per_step(tmp_path, corpus):
    steps = 16
    proc = run_study(
        f"data.path={corpus}",
        *TINY_GPT,
        "generate.max_new_tokens=0",
        f"training.max_steps={steps}",
        "checkpoint.save_best=false",
        "distributed.bucket_cap_mb=0.01",
        "--nproc",
        "2",
        "--set",
        "distributed.simulated_latency_ms=0,20",
        "--name",
        "delay",
        cwd=tmp_path,
    )
    assert_ok(proc)
    study = tmp_path / "experiments" / "delay"

    def per_step(name):
        rows = json.loads((study / name / "metrics.json").read_text())["epochs"]
        return (
            sum(r["comm_time_s"] for r in rows) / steps,
            sum(r["comm_calls"] for r in rows) / steps,
            sum(r["simulated_delay_s"] for r in rows),
        )

    base, buckets, no_delay = per_step("n2-simulated_latency_ms_0")
    slow, buckets_slow, delay = per_step("n2-simulated_latency_ms_20")
    assert buckets == buckets_slow and buckets > 1  # a small bucket cap: several all-reduces per step
    assert no_delay == 0 and delay == pytest.approx(0.020 * buckets * steps)
    expected = 0.020 * buckets
    assert 0.5 * expected < slow - base < 1.5 * expected, (base, slow, buckets)
    rows = {r["point"]: r for r in csv.DictReader(open(study / "report.csv"))}
    shown = float(rows["n2-simulated_latency_ms_20"]["comm_ms_per_step"]) - float(
        rows["n2-simulated_latency_ms_0"]["comm_ms_per_step"]
    )
    assert shown == pytest.approx(1000 * (slow - base), rel=1e-6)
    assert "comm ms/step" in (study / "report.md").read_text()


def test_powersgd_trains_two_processes_in_step_and_changes_the_gradients(tmp_path, corpus):
    """PowerSGD end to end in real processes: after its two plain warm-up steps it compresses,
    so the weights leave those of uncompressed all-reduce while the two replicas stay equal."""
    proc = run_study(
        f"data.path={corpus}",
        *TINY_GPT,
        "generate.max_new_tokens=0",
        "training.max_steps=8",
        "checkpoint.save_best=false",
        "--nproc",
        "2",
        "--set",
        "distributed.comm_hook=none,powersgd",
        "--name",
        "psgd",
        cwd=tmp_path,
    )
    assert_ok(proc)
    points = (tmp_path / "experiments/psgd").glob("*/metrics.json")
    summaries = {p.parent.name: json.loads(p.read_text()) for p in points}
    assert len(summaries) == 2, list(summaries)
    (plain,) = (s for name, s in summaries.items() if name.endswith("none"))
    (compressed,) = (s for name, s in summaries.items() if name.endswith("powersgd"))
    for s in (plain, compressed):
        assert s["status"] == "complete" and s["ddp"]["ranks_identical"] and s["aggregates"]["steps"] == 8
        assert all(r["train_loss"] == r["train_loss"] for r in s["epochs"])  # finite, not NaN
    assert compressed["config"]["distributed"]["comm_hook"] == "powersgd"
    assert compressed["ddp"]["parameter_digests"][0] != plain["ddp"]["parameter_digests"][0]
