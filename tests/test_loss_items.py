"""What a Hugging Face model's own mean loss is over: the count that times it gives its summed loss, for a causal
LM (which scores its labels shifted by one) and a seq2seq model (which scores them all)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ddplab
from ddplab.tasks import item_counter

transformers = pytest.importorskip("transformers")


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[1, 6:] = -100  # padding, not scored
    return labels


def test_a_causal_lm_counts_its_shifted_labels():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    config.update({"bos_token_id": 0, "eos_token_id": 0})
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50, (2, 10))
    labels = _labels(ids)
    out = model(input_ids=ids, labels=labels)
    summed = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    count = item_counter(ddplab.Task(), model)(labels)
    assert int(count) == 14 and float(out.loss * count) == pytest.approx(float(summed), rel=1e-5)


def test_a_seq2seq_model_counts_every_label_and_a_tasks_own_count_stays():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    config.update({"dropout_rate": 0.0, "pad_token_id": 0, "decoder_start_token_id": 0})
    model = transformers.T5ForConditionalGeneration(config)
    ids = torch.randint(1, 50, (2, 10))
    labels = _labels(ids)
    out = model(input_ids=ids, labels=labels)
    summed = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), reduction="sum")
    count = item_counter(ddplab.Task(), model)(labels)
    assert int(count) == 16 and float(out.loss * count) == pytest.approx(float(summed), rel=1e-5)

    class Own(ddplab.Task):
        def items(self, target):
            return torch.tensor(3)

    assert int(item_counter(Own(), model)(labels)) == 3
