"""Any Hugging Face AutoModelForSequenceClassification, from a hub name or a local folder."""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn

from ddplab.errors import UserError
from ddplab.models.checks import check_pretrained, looks_like_path


def build(cfg, bundle) -> nn.Module:
    from transformers import AutoModelForSequenceClassification

    check_pretrained(cfg.model.pretrained)
    names = bundle.meta.get("label_names") or [str(i) for i in range(bundle.num_classes)]
    try:
        # A pretrained encoder gets a fresh head sized to this data's labels.
        model = AutoModelForSequenceClassification.from_pretrained(
            str(Path(cfg.model.pretrained).expanduser()) if looks_like_path(cfg.model.pretrained) else cfg.model.pretrained,
            num_labels=bundle.num_classes, id2label=dict(enumerate(names)),
            label2id={n: i for i, n in enumerate(names)}, ignore_mismatched_sizes=True)
    except (OSError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise UserError(f"model.pretrained: cannot load '{cfg.model.pretrained}' as a sequence classifier ({first}); "
                        f"give a local model folder, or a hub name on a connected machine") from None
    if cfg.model.freeze:
        for p in model.base_model.parameters():
            p.requires_grad_(False)
    return model
