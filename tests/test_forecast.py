"""`ddplab forecast`: the all-reduce maths, the overlap with backward, a forecast from a study
folder (metrics.json files written by real tiny runs), what runs record, and bad inputs."""

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import OneRankCtx
from ddplab.cli import main
from ddplab.config import batch_arithmetic
from ddplab.forecast.links import Link, allreduce_s, parse_bandwidth, parse_latency, ring_allreduce_s, wire_messages
from ddplab.forecast.model import overlapped_backward

STUDY = Path(__file__).parent / "data" / "forecast_study"


def test_ring_allreduce_alpha_beta_by_hand():
    # 1 MB over 4 ranks at 100 MB/s and 10 us: 2*3/4 * 1e6 / 1e8 = 15 ms, plus 2*3 messages * 10 us.
    assert ring_allreduce_s(1e6, 4, Link(1e-5, 1e8)) == pytest.approx(0.015 + 6e-5)
    # 2 ranks send the whole payload once: 1 MB at 125 MB/s (1 Gbit/s) = 8 ms, plus 2 messages.
    assert ring_allreduce_s(1e6, 2, Link(1e-4, parse_bandwidth("1Gbit"))) == pytest.approx(0.008 + 2e-4)
    assert ring_allreduce_s(1e6, 1, Link(1.0, 1.0)) == 0.0


def test_hierarchical_allreduce_by_hand():
    intra, inter = Link(1e-6, 1e10), Link(1e-5, 1e9)
    # 8 MB on 2 nodes x 4: inside a node 2*3/4 * 8e6/1e10 + 6 us = 1206 us; across the 2 nodes
    # 2*1/2 * 8e6/1e9 + 2 * 10 us = 8.02 ms.
    assert allreduce_s(8e6, 2, 4, inter, intra) == pytest.approx(1206e-6 + 8.02e-3)
    assert allreduce_s(8e6, 1, 4, inter, intra) == pytest.approx(1206e-6)  # one node: the fast link only
    assert allreduce_s(8e6, 4, 1, inter, intra) == pytest.approx(ring_allreduce_s(8e6, 4, inter))


def test_hooks_change_the_bytes_on_the_wire():
    bucket = {"numel": 64 * 64 + 64, "bytes": 4 * (64 * 64 + 64), "matrices": [[64, 64]]}
    assert wire_messages(bucket, "none") == [bucket["bytes"]]
    assert wire_messages(bucket, "fp16") == [bucket["bytes"] / 2]
    # PowerSGD rank 1: the bias uncompressed, then P (64 x 1) and Q (64 x 1), 4 bytes each.
    assert wire_messages(bucket, "powersgd", rank=1) == [64 * 4, 64 * 4, 64 * 4]
    # A matrix that would not compress 2x is sent as it is.
    small = {"numel": 4 * 4, "bytes": 64, "matrices": [[4, 4]]}
    assert wire_messages(small, "powersgd", rank=2) == [64]


def test_bucket_overlap_hides_all_but_the_tail():
    buckets = [{"bytes": 100}, {"bytes": 100}]
    msgs = [[100], [100]]
    # Backward 10 ms; buckets ready at 5 and 10 ms. At 3 ms each, the first hides entirely behind
    # backward and only the last bucket's 3 ms shows.
    end, comm, exposed = overlapped_backward(0.010, buckets, msgs, lambda n: 0.003)
    assert (end, comm, exposed) == pytest.approx((0.013, 0.006, 0.003))
    # At 7 ms each the first ends at 12 ms and the second queues behind it: 19 ms, 9 ms shown.
    end, comm, exposed = overlapped_backward(0.010, buckets, msgs, lambda n: 0.007)
    assert (end, exposed) == pytest.approx((0.019, 0.009))
    # A simulated delay of 1 ms per bucket sleeps on the backward thread: it postpones the
    # second bucket's gradients too, so backward computing ends at 12 ms and the tail is 3 ms.
    end, comm, exposed = overlapped_backward(0.010, buckets, msgs, lambda n: 0.003, delays=[0.001, 0.001])
    assert (end, exposed) == pytest.approx((0.015, 0.003))


def test_fsdp_gathers_each_unit_ahead_of_its_compute_and_reduces_after_it():
    from ddplab.forecast.sharded import gathered_pass

    units = [{"bytes": 100}, {"bytes": 100}]
    # Forward 10 ms over two units, a 3 ms gather each: the first gather shows (3 ms), the second
    # runs while the first unit computes (3 to 8 ms): the pass ends at 13 ms, 6 ms communicating.
    assert gathered_pass(0.010, units, lambda n: 0.003) == pytest.approx((0.013, 0.006))
    # Backward with a 2 ms reduce-scatter after each unit: units end at 8 and 13 ms, their
    # reductions at 10 and 15 ms.
    assert gathered_pass(0.010, units, lambda n: 0.003, lambda n: 0.002) == pytest.approx((0.015, 0.010))


def test_fsdp_step_and_bytes_beside_ddp_by_hand():
    from ddplab.forecast.model import Comm, Compute, predict_step
    from ddplab.forecast.sharded import sent_bytes

    # Per step: forward 4 ms, backward 8 ms, 2 ms of optimizer; 1 MB of parameters in one unit/bucket.
    compute = Compute(forward=(0.004, 0.0), backward=(0.008, 0.0), data_wait=(0.0, 0.0), rest=(0.002, 0.0), timed=True)
    link, buckets = Link(0.0, 1e8), [{"bytes": 1e6, "numel": 250_000}]
    # 2 processes at 100 MB/s: DDP's all-reduce sends 1/2 x 2 x 1 MB = 10 ms after backward: 24 ms.
    ddp = predict_step(compute, Comm(buckets), 1, 2, 32, link, link)
    assert (ddp.step_s, ddp.comm_s, ddp.sent_bytes) == pytest.approx((0.024, 0.010, 1e6))
    # fsdp gathers 1/2 x 1 MB (5 ms) before forward, again before backward, and reduce-scatters
    # 5 ms after it: 14 + 15 = 29 ms, 1.5 MB sent.
    fsdp = predict_step(compute, Comm(buckets, strategy="fsdp"), 1, 2, 32, link, link)
    assert (fsdp.step_s, fsdp.comm_s, fsdp.exposed_s, fsdp.sent_bytes) == pytest.approx((0.029, 0.015, 0.015, 1.5e6))
    # Per rank and step: ddp 2 (N-1)/N, fsdp 3 (N-1)/N of the bytes (5 (N-1)/N with 2 micro-steps,
    # which gather twice each); hsdp on 2 nodes x 2: 3 x 1/2 inside the node, then its half shard
    # all-reduced across the 2 nodes (2 x 1/2 x 1/2).
    assert sent_bytes("ddp", 1e6, 1, 4, 1) == pytest.approx(1.5e6)
    assert sent_bytes("fsdp", 1e6, 1, 4, 1) == pytest.approx(2.25e6)
    assert sent_bytes("fsdp", 1e6, 1, 4, 2) == pytest.approx(3.75e6)
    assert sent_bytes("hsdp", 1e6, 2, 2, 1) == pytest.approx(2.0e6)
    # hsdp on one node is fsdp; across nodes the gathers stay on the fast link.
    fast, slow = Link(0.0, 1e10), Link(0.0, 1e7)
    one_node = [predict_step(compute, Comm(buckets, strategy=s), 1, 4, 32, slow, fast).step_s for s in ("fsdp", "hsdp")]
    assert one_node[0] == pytest.approx(one_node[1])
    two_nodes = {s: predict_step(compute, Comm(buckets, strategy=s), 2, 2, 32, slow, fast) for s in ("fsdp", "hsdp")}
    assert two_nodes["hsdp"].step_s < two_nodes["fsdp"].step_s


def test_the_units_fsdp_gathers_as_run_or_as_it_would_shard():
    from ddplab.engine.parallel.sharding import fsdp_units

    # A block of 4 x 100 + 100 = 500 parameters is sharded on its own; the root keeps the first layer's 20.
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 100))
    assert fsdp_units(model, min_params=100) == [{"bytes": 80, "params": 2}, {"bytes": 2000, "params": 2}]
    assert fsdp_units(model, min_params=10_000) == [{"bytes": 2080, "params": 4}]


def test_compute_from_two_batch_sizes_is_a_fixed_part_plus_a_part_per_sample():
    from ddplab.forecast.model import Measured, fit_compute

    def single(batch, step_s, forward, backward):
        return Measured(
            name=f"b{batch}",
            nodes=1,
            per_node=1,
            batch=batch,
            accum=1,
            train_samples=960,
            steps_per_epoch=960 // batch,
            epoch_times=[step_s * (960 // batch)],
            forward=forward,
            backward=backward,
            data_wait=0.0,
            latency_ms=0.0,
            bandwidth_mbps=None,
            hook="none",
        )

    # Steps of 10 ms at batch 32 and 14 ms at batch 64: 6 ms fixed, 0.125 ms per sample.
    two = fit_compute([single(32, 0.010, 0.003, 0.006), single(64, 0.014, 0.004, 0.008)])
    assert two.step_s(96) == pytest.approx(0.018)
    assert two.forward == pytest.approx((0.002, 1 / 32_000))
    # From one batch size, every part but the optimizer's is taken as proportional to the batch.
    one = fit_compute([single(32, 0.010, 0.003, 0.006)])
    assert one.step_s(64) == pytest.approx(0.001 + 2 * 0.009)


def test_units_and_steps_per_epoch():
    assert parse_bandwidth("25Gbit") == pytest.approx(25e9 / 8)
    assert parse_bandwidth("200GB/s") == pytest.approx(200e9)
    assert parse_latency("50us") == pytest.approx(50e-6)
    # The sampler pads ranks to ceil(N/p): 1687 samples on 2 ranks at 8 -> 844 per rank -> 106 steps.
    assert batch_arithmetic(8, 1, 2, 1687)["steps_per_epoch"] == 106
    assert batch_arithmetic(8, 2, 1, 1687)["steps_per_epoch"] == 106


def _forecast(tmp_path, *extra):
    out = tmp_path / "out"
    code = main(["forecast", str(STUDY), "--output", str(out), *extra])
    assert code == 0
    rows = list(csv.DictReader(open(out / "forecast.csv")))
    return out, {r["setup"]: r for r in rows}


def test_forecast_of_a_study_folder_fits_the_link_and_writes_its_files(tmp_path, capsys):
    out, rows = _forecast(tmp_path, "--setups", "1x1,1x2,2x1,4x1,2x8", "--budget", "1h")
    assert (out / "forecast.png").stat().st_size > 10_000
    md = (out / "forecast.md").read_text()
    assert "link FITTED" in md and "residual" in md
    one = rows["1x1"]
    assert float(one["speedup"]) == pytest.approx(1.0) and float(one["comm_share"]) == 0.0
    # The 1-process compute is the measured one: the fixture's n1 run.
    n1 = json.loads((STUDY / "n1" / "metrics.json").read_text())
    measured = n1["epochs"][0]["epoch_time_s"]
    assert float(one["epoch_s"]) == pytest.approx(measured, rel=0.01)
    for row in rows.values():
        assert float(row["epoch_s"]) == pytest.approx(int(row["steps_per_epoch"]) * float(row["step_ms"]) / 1e3)
        assert float(row["epochs_in_budget"]) == pytest.approx(3600 / float(row["epoch_s"]))
    # More processes, more communication and a lower efficiency.
    assert float(rows["2x8"]["comm_ms"]) > float(rows["4x1"]["comm_ms"]) > float(rows["2x1"]["comm_ms"]) > 0
    assert float(rows["2x8"]["efficiency"]) < float(rows["2x1"]["efficiency"]) <= 1.0


def test_a_slower_given_link_costs_more_and_fp16_halves_the_transfer(tmp_path):
    _, fast = _forecast(tmp_path, "--setups", "4x1", "--bandwidth", "10Gbit", "--latency", "10us")
    _, slow = _forecast(tmp_path, "--setups", "4x1", "--bandwidth", "10Mbit", "--latency", "10us")
    _, half = _forecast(
        tmp_path, "--setups", "4x1", "--bandwidth", "10Mbit", "--latency", "10us", "--comm-hook", "fp16"
    )
    assert float(slow["4x1"]["step_ms"]) > float(fast["4x1"]["step_ms"])
    assert float(slow["4x1"]["comm_share"]) > float(fast["4x1"]["comm_share"])
    # At 10 Mbit/s the transfer dominates the all-reduce: fp16 takes it to about half.
    assert float(half["4x1"]["comm_ms"]) == pytest.approx(float(slow["4x1"]["comm_ms"]) / 2, rel=0.02)


def test_a_strategy_that_was_not_measured_is_forecast_beside_the_runs_own(tmp_path):
    # The fixture's runs are ddp; at 10 Mbit/s and 10 us on 2 processes, fsdp's three half-ring
    # collectives cost 1.5x DDP's all-reduce, time and bytes (one unit: nothing overlaps).
    out = tmp_path / "out"
    assert (
        main(
            [
                "forecast",
                str(STUDY),
                "--output",
                str(out),
                "--setups",
                "1x1,2x1",
                "--bandwidth",
                "10Mbit",
                "--latency",
                "10us",
                "--strategy",
                "ddp,fsdp",
            ]
        )
        == 0
    )
    rows = {(r["strategy"], r["setup"]): r for r in csv.DictReader(open(out / "forecast.csv"))}
    ddp, fsdp = rows["ddp", "2x1"], rows["fsdp", "2x1"]
    grad = json.loads((STUDY / "n1" / "metrics.json").read_text())["comm"]["grad_bytes"]
    assert float(ddp["sent_mb"]) == pytest.approx(grad / 1e6) and float(fsdp["sent_mb"]) == pytest.approx(
        1.5 * grad / 1e6
    )
    assert float(fsdp["comm_ms"]) == pytest.approx(1.5 * float(ddp["comm_ms"]))
    assert float(rows["fsdp", "1x1"]["step_ms"]) == pytest.approx(float(rows["ddp", "1x1"]["step_ms"]))
    assert "| fsdp | 2x1 |" in (out / "forecast.md").read_text()


def _exit_code(argv) -> int:
    """main()'s return code, or the code argparse exits with."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


@pytest.mark.parametrize(
    "args, words",
    [
        (["--setups", "2y1"], "--setups: '2y1'"),
        (["--bandwidth=-5Gbit"], "--bandwidth must be positive"),
        (["--bandwidth", "-5Gbit"], "--bandwidth: expected one argument"),
        (["--bandwidth", "5Gfoo"], "unknown unit"),
        (["--latency", "5"], "--latency: expected a number with a unit"),
        (["--budget", "soon"], "--budget"),
        (["--strategy", "zero3"], "--strategy: expected ddp, fsdp or hsdp"),
        (["--strategy", "fsdp", "--comm-hook", "fp16"], "is a DDP communication hook"),
    ],
)
def test_bad_options_exit_2_with_one_line(tmp_path, capsys, args, words):
    assert _exit_code(["forecast", str(STUDY), "--output", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err
    assert not (tmp_path / "forecast.md").exists()


def test_a_folder_without_runs_exits_2_with_one_line(tmp_path, capsys):
    assert main(["forecast", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no finished run folders" in err


def test_without_multi_process_runs_the_link_must_be_given(tmp_path, capsys):
    shutil.copytree(STUDY / "n1", tmp_path / "n1")
    assert main(["forecast", str(tmp_path), "--output", str(tmp_path / "a")]) == 2
    assert "give --bandwidth and --latency" in capsys.readouterr().err
    assert (
        main(
            [
                "forecast",
                str(tmp_path),
                "--output",
                str(tmp_path / "b"),
                "--bandwidth",
                "1Gbit",
                "--latency",
                "20us",
                "--setups",
                "1x1,2x1",
            ]
        )
        == 0
    )
    assert "(given)" in (tmp_path / "b" / "forecast.md").read_text()


def test_runs_record_buckets_and_forward_backward_time(one_rank_group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.config import Config, DistributedConfig
    from ddplab.engine.parallel.ddp_comm import attach_step_timer, comm_summary, epoch_comm_row, install_comm_hook

    torch.manual_seed(0)
    raw = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    model = DDP(raw, bucket_cap_mb=0.5)
    dcfg = DistributedConfig(bucket_cap_mb=0.5)
    monitor = install_comm_hook(model, dcfg, OneRankCtx())
    timer = attach_step_timer(raw, monitor, Config())
    for _ in range(4):
        model(torch.randn(16, 64)).square().mean().backward()
    with torch.no_grad():
        raw(torch.randn(16, 64))  # evaluation: not timed
    row = epoch_comm_row(monitor, OneRankCtx(), epoch_time=1.0, timer=timer)
    assert row["timed_micro_steps"] == 4
    assert row["forward_time_s"] > 0 and row["backward_time_s"] > 0 and row["comm_exposed_s"] >= 0
    summary = comm_summary(raw, monitor, dcfg)
    params = sum(p.numel() for p in raw.parameters())
    assert summary["bucket_source"] == "reducer" and summary["grad_dtype"] == "float32"
    assert summary["grad_bytes"] == 4 * params == sum(b["bytes"] for b in summary["buckets"])
    # Without a reducer the buckets are the ones DDP would make: the same total, split at the
    # first-bucket cap (1 MiB) and then at bucket_cap_mb, never inside a tensor: here one per layer.
    computed = comm_summary(raw, None, dcfg)
    assert computed["bucket_source"] == "computed" and computed["grad_bytes"] == 4 * params
    big = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.Linear(4096, 512))
    layout = comm_summary(big, None, dcfg)["buckets"]
    assert len(layout) == 2 and sum(b["bytes"] for b in layout) == 4 * sum(p.numel() for p in big.parameters())
