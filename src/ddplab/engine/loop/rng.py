"""This process's random streams: seeding, and capturing / restoring them for exact resume, as plain lists (rank 0
gathers every rank's; a snapshot loads with `torch.load(weights_only=True)`)."""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple)  # a dict only where the global generator is not MT19937
    kind, keys, pos, has_gauss, cached = legacy
    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state().tolist(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
