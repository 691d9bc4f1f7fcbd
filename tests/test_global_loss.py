"""A loss that is a mean over tokens is averaged over the step's global count of them: accumulation equals a
bigger batch, padding included (N processes against one: test_predict_inputs' verify)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ddplab
from ddplab.engine.snapshots.read import load_snapshot
from ddplab.engine.snapshots.write import Checkpointer
from ddplab.tasks import Classification, LanguageModeling, Task

HERE = Path(__file__).resolve().parent
S2S = [f"model.name={HERE / 'hf_workloads.py'}:t5", f"data.name={HERE / 'hf_workloads.py'}:seq2seq_data"]
FAST = ["logging.trackers=[]", "logging.progress=false", "training.warmup_steps=0", "logging.log_every=1"]


def _run(tmp_path: Path, name: str, *extra: str) -> tuple[list[float], dict, dict]:
    ddplab.train(None, [*S2S, "training.max_steps=3", "training.lr=0.01", f"experiment.name={name}", *FAST, *extra])
    run = tmp_path / "experiments" / name
    summary = json.loads((run / "metrics.json").read_text())
    weights = load_snapshot(Checkpointer(run / "checkpoints", is_main=False).latest())["model"]
    return [row["loss"] for row in summary["steps"]], weights, summary


def test_accumulation_equals_a_bigger_batch_for_a_token_mean_loss(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    big, w_big, summary = _run(tmp_path, "big", "training.batch_size=8")
    acc, w_acc, _ = _run(tmp_path, "acc", "training.batch_size=4", "training.grad_accum_steps=2")
    assert summary["model"]["loss_average"] == "items"
    assert len(big) == len(acc) == 3
    assert max(abs(a - b) / b for a, b in zip(acc, big, strict=True)) < 1e-5, (acc, big)
    assert max((w_big[k].float() - w_acc[k].float()).abs().max().item() for k in w_big) < 1e-5


def test_what_each_task_counts():
    tokens = torch.tensor([[5, 6, -100], [7, -100, -100]])
    assert Task().items(tokens).item() == 3  # token labels, -100 left out
    assert Task().items(torch.tensor([0, 1])) is None  # one target per sample: a mean over samples
    assert LanguageModeling().items(tokens).item() == 3
    assert LanguageModeling(shift=True).items(tokens).item() == 1  # each sequence's first is not scored
    assert Classification(2).items(torch.tensor([0, 1])) is None
