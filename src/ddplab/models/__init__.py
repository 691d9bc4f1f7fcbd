"""Built-in models (declared in ddplab.registry): plain nn.Modules that take a small config and
know nothing of torch.distributed, YAML or files."""

from __future__ import annotations


def build_model(cfg, data):
    """The built-in model `model.name` names, for `data` (a ddplab.Data)."""
    from ddplab.registry import model_spec

    return model_spec(cfg.model.name).load()(cfg, data)
