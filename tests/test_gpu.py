"""What only a GPU shows: autocast with GradScaler, torch.compile, MFU and NVML columns.

Skipped without CUDA (CI has none); run on a GPU machine with `pytest -m gpu`.
"""

import json

import pytest
import torch

from conftest import TINY_GPT
from ddplab.commands.run import train
from ddplab.engine.snapshots.read import load_file
from ddplab.registry import load_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(tmp_path, corpus, *overrides):
    cfg = load_config(
        None,
        [
            f"data.path={corpus}",
            *TINY_GPT,
            "generate.max_new_tokens=0",
            "model.dropout=0",
            f"experiment.output_dir={tmp_path}",
            "training.lr=3e-3",
            *overrides,
        ],
    )
    train(cfg)
    run = tmp_path / cfg.run_name()
    return run, json.loads((run / "metrics.json").read_text())


def _val_losses(summary):
    return [r["val_loss"] for r in summary["epochs"]]


def test_fp16_with_grad_scaler_learns_and_snapshots_the_scale(tmp_path, corpus):
    run, summary = _run(tmp_path, corpus, "training.amp=fp16", "training.epochs=3", "experiment.name=fp16")
    losses = _val_losses(summary)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    snapshots = sorted((run / "checkpoints").glob("step-*/state.pt"))
    scaler = load_file(snapshots[-1])["scaler"]
    assert scaler["scale"] > 0  # an enabled GradScaler's state, restored on resume


@pytest.mark.multiproc  # torch.compile's inductor starts its compile workers
def test_bf16_compile_records_throughput_mfu_and_gpu_columns(tmp_path, corpus):
    _, summary = _run(
        tmp_path, corpus, "training.amp=bf16", "training.compile=true", "training.epochs=2", "experiment.name=bf16"
    )
    losses = _val_losses(summary)
    assert losses[-1] < losses[0]
    row = summary["epochs"][-1]
    assert row["tokens_per_s"] > 0 and row["peak_mem_mb"] > 0
    name = torch.cuda.get_device_name(0)
    from ddplab.metrics.throughput import peak_flops

    if peak_flops(torch.device("cuda", 0)) is not None:
        assert 0 < row["mfu"] < 1, name
    assert 0 <= row["gpu_util"] <= 100 and row["gpu_mem_mb"] > 0
    assert summary["model"]["flops_per_token"] > 0


def test_same_seed_same_losses_on_gpu_up_to_atomic_adds(tmp_path, corpus):
    """Embedding backward accumulates with atomic adds on CUDA, so bits may differ; values may not."""
    _, one = _run(tmp_path, corpus, "training.max_steps=10", "experiment.name=one", "logging.log_every=1")
    _, two = _run(tmp_path, corpus, "training.max_steps=10", "experiment.name=two", "logging.log_every=1")
    a, b = [s["loss"] for s in one["steps"]], [s["loss"] for s in two["steps"]]
    assert len(a) == 10 and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fsdp over NCCL needs 2 CUDA devices")
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_fsdp_over_nccl_computes_in_low_precision_and_reduces_in_fp32(tmp_path, corpus, amp):
    from conftest import assert_ok, torchrun

    assert_ok(
        torchrun(
            2,
            "train",
            f"data.path={corpus}",
            *TINY_GPT,
            "generate.max_new_tokens=0",
            "training.epochs=2",
            "training.lr=3e-3",
            f"training.amp={amp}",
            "distributed.strategy=fsdp",
            "experiment.name=f",
            cwd=tmp_path,
        )
    )
    summary = json.loads((tmp_path / "experiments" / "f" / "metrics.json").read_text())
    assert summary["ddp"]["backend"] == "nccl" and summary["ddp"]["strategy"] == "fsdp"
    losses = _val_losses(summary)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    # The sharded fp32 master weights (4 bytes each, half per rank); the collectives timed on the device.
    assert summary["ddp"]["state_bytes_per_rank"]["parameters"] < 0.55 * 4 * summary["model"]["parameters"]
    assert all(row["comm_time_s"] > 0 for row in summary["epochs"])
