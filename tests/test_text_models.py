"""The scratch Transformer classifier as a plain module."""

import pytest
import torch

from ddplab.models.transformer import TransformerClassifier, TransformerConfig


def model(pooling: str) -> TransformerClassifier:
    torch.manual_seed(0)
    return TransformerClassifier(
        TransformerConfig(
            vocab_size=100, num_classes=3, max_len=16, layers=2, heads=2, dim=16, dropout=0.1, pooling=pooling
        )
    ).eval()


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_padding_does_not_change_the_logits(pooling):
    m = model(pooling)
    ids = torch.tensor([[1, 5, 9, 42]])
    short = m(input_ids=ids, attention_mask=torch.ones_like(ids))
    padded = torch.tensor([[1, 5, 9, 42, 0, 0, 0]])
    long = m(input_ids=padded, attention_mask=(padded != 0).long())
    assert short.shape == (1, 3)
    assert torch.allclose(short, long, atol=1e-5)
    assert torch.allclose(m(input_ids=padded), long)  # mask inferred from the pad id


def test_positions_and_words_matter_and_gradients_flow():
    m = model("cls").train()
    a = m.eval()(input_ids=torch.tensor([[1, 5, 9]]))
    b = m(input_ids=torch.tensor([[1, 9, 5]]))
    c = m(input_ids=torch.tensor([[1, 5, 8]]))
    assert not torch.allclose(a, b) and not torch.allclose(a, c)
    m.train()
    loss = torch.nn.functional.cross_entropy(m(input_ids=torch.randint(2, 100, (4, 10))), torch.tensor([0, 1, 2, 0]))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters() if p.requires_grad)


def test_flops_per_token_agrees_with_torch_flop_counter():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    m = TransformerClassifier(
        TransformerConfig(vocab_size=100, num_classes=3, max_len=32, layers=2, heads=2, dim=64, dropout=0.0)
    ).train()
    ids = torch.randint(2, 100, (4, 32))  # full length: no padding
    # The math backend runs attention as plain matmuls, which the counter sees (fused kernels it may not).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        m(input_ids=ids).sum().backward()
    measured = counter.get_total_flops() / ids.numel()
    assert abs(m.flops_per_token() - measured) / measured < 0.05
