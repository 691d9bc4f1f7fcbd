"""The loop's arithmetic, in one process (no process group needed)."""

import json
import math
import re

import pytest

from conftest import TINY_GPT
from ddplab.commands.run import train
from ddplab.engine.loop.optim import lr_lambda, scaled_lr
from ddplab.registry import load_config


def _run(tmp_path, corpus, *overrides):
    cfg = load_config(
        None,
        [
            f"data.path={corpus}",
            *TINY_GPT,
            "generate.max_new_tokens=0",
            "model.dropout=0",
            "logging.log_every=1",
            f"experiment.output_dir={tmp_path}",
            *overrides,
        ],
    )
    train(cfg)
    return json.loads((tmp_path / cfg.run_name() / "metrics.json").read_text())


def test_gradient_accumulation_equals_the_larger_batch(tmp_path, corpus):
    big = _run(tmp_path, corpus, "training.batch_size=16", "training.max_steps=6", "experiment.name=big")
    acc = _run(
        tmp_path,
        corpus,
        "training.batch_size=8",
        "training.grad_accum_steps=2",
        "training.max_steps=6",
        "experiment.name=acc",
    )
    assert acc["ddp"]["global"] == big["ddp"]["global"] == 16
    a = [s["loss"] for s in acc["steps"]]
    b = [s["loss"] for s in big["steps"]]
    assert len(a) == len(b) == 6
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def test_same_seed_same_numbers(tmp_path, corpus):
    one = _run(tmp_path, corpus, "training.max_steps=5", "experiment.name=one", "model.dropout=0.1")
    two = _run(tmp_path, corpus, "training.max_steps=5", "experiment.name=two", "model.dropout=0.1")
    assert [s["loss"] for s in one["steps"]] == [s["loss"] for s in two["steps"]]


def test_bf16_autocast_sgd_and_step_evaluation(tmp_path, corpus):
    out = _run(
        tmp_path,
        corpus,
        "training.amp=bf16",
        "training.optimizer=sgd",
        "training.lr=0.05",
        "training.max_steps=4",
        "training.eval_every=2",
        "experiment.name=amp",
    )
    assert out["status"] == "complete" and all(math.isfinite(s["loss"]) for s in out["steps"])
    log = (tmp_path / "amp" / "train.log").read_text()
    # Evaluation lines ("step N: loss .., perplexity ..") every 2 steps, not the training log lines.
    evaluated = re.findall(r"^\S+ \S+ step (\d+): loss [^,\n]+, perplexity", log, re.M)
    assert evaluated == ["2", "4"], log


def test_warmup_then_cosine():
    assert lr_lambda(0, 10, 100, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_lambda(9, 10, 100, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_lambda(55, 10, 100, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_lambda(100, 10, 100, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_lambda(55, 10, 100, "linear", 0.0) == pytest.approx(0.5)
    assert lr_lambda(500, 0, 100, "constant", 0.1) == 1.0


def test_lr_scaling_with_world_size():
    assert scaled_lr(1e-3, "none", 8) == 1e-3
    assert scaled_lr(1e-3, "linear", 8) == pytest.approx(8e-3)
    assert scaled_lr(1e-3, "sqrt", 4) == pytest.approx(2e-3)


def test_gpt_flops_per_token_agrees_with_torch_flop_counter():
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ddplab.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, context=32, layers=2, heads=2, dim=64))
    x = torch.randint(0, 64, (4, 32))
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    measured = counter.get_total_flops() / x.numel()
    assert abs(model.flops_per_token() - measured) / measured < 0.1


def test_mfu_only_for_known_gpus():
    import torch

    from ddplab.metrics.throughput import mfu

    class M(torch.nn.Module):
        def flops_per_token(self):
            return 1e9

    assert mfu(M(), 1000.0, torch.device("cpu"), 1) is None
