"""Fault tolerance as the Trainer is handed it: `NoReplicas` (one job, a failure ends it) or replicas.py's
`Replicas` (distributed.fault_tolerance=replicas), which overrides each method below."""

from __future__ import annotations

from collections.abc import Callable

import torch

# What a rejoining replica group receives from a healthy one: the snapshot's parts that change every step.
LIVE = ("model", "optimizer", "scheduler", "scaler", "trainer")


class NoReplicas:
    """No fault tolerance, the plain default."""

    def register(self, parts) -> None:
        """Its own snapshot part, and the parts a peer sends when this process rejoins: none."""

    def sync_step(self, step: int) -> None:
        """The step a resume starts from, told to the peers: none."""

    def begin_step(self) -> bool:
        """Join this step's quorum; True when a peer's state replaced this process's (never here)."""
        return False

    def agree(self, params, optimizer, stop: Callable[[], torch.Tensor], step: int, samples: int) -> bool:
        """Whether the step counts, its gradients averaged over the peers: always, there are none."""
        return True

    def restore_lr(self, optimizer) -> None:
        """Undo what agree() did to the learning rate for this step: nothing."""

    def stop(self, own: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The stop flags all ranks reduce: (time budget over, stop signal), this process's own."""
        return own()[:2]

    def spent(self, own: float) -> float:
        """The seconds a time budget's schedule is planned on: this process's own."""
        return own

    def epoch_columns(self) -> dict:
        return {}

    def shares(self, world_size: int, shares: int) -> str:
        """What the global batch is divided among, in words."""
        return f"{shares} processes"

    def close(self) -> None:
        """Nothing to release."""
