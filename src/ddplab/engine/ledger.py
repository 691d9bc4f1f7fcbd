"""The training loss, samples and tokens since the last log, kept off the step's critical path.

Per micro-batch the step writes two numbers to the device (its summed loss and what it is a mean
over: the task's items, else its samples) and appends the sample count, which the host already knows;
sums, the non-finite check and the host sync happen once per log interval, in `totals()`.
"""

from __future__ import annotations

import math

import torch


class LossLedger:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        # per micro-batch: its loss summed over what it averages, and that count
        self.losses = torch.zeros(max(capacity, 1), 2, dtype=torch.float32, device=device)
        self.samples: list[int] = []  # per micro-batch
        self.steps: list[int] = []  # the optimizer step each micro-batch belongs to
        self.tokens = 0  # counted on the host where the host knows them
        self.device_tokens: torch.Tensor | None = None  # counted on the device (attention masks)

    def add(self, loss: torch.Tensor, samples: int, tokens, step: int, items: torch.Tensor | None = None) -> None:
        """`loss`: the micro-batch's mean, over `items` (the task's count) or else its samples."""
        j = len(self.samples)
        if j == len(self.losses):
            self.losses = torch.cat([self.losses, torch.zeros_like(self.losses)])
        if items is None:  # the host knows the weight: filled in, no copy to the device
            self.losses[j, 0], self.losses[j, 1] = loss.detach() * samples, samples
        else:
            self.losses[j] = torch.stack([loss.detach().float() * items, items.float()])
        self.samples.append(samples)
        self.steps.append(step)
        if isinstance(tokens, torch.Tensor):
            self.device_tokens = tokens if self.device_tokens is None else self.device_tokens + tokens
        else:
            self.tokens += tokens

    def step_loss(self, step: int) -> torch.Tensor:
        """The summed loss of one step's micro-batches (for the skip-a-non-finite-step check)."""
        return self.losses[self.steps.index(step) : len(self.steps), 0].sum()

    def drop_step(self, step: int) -> None:
        """Forget a skipped step: its loss stays out of the logged mean."""
        while self.steps and self.steps[-1] == step:
            self.steps.pop()
            self.samples.pop()

    def totals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, what it is a sum over, samples, tokens) and the first step with a non-finite loss (inf if
        none), as device tensors ready to be reduced; the ledger starts over."""
        n = len(self.samples)
        losses, weights = self.losses[:n].double().unbind(1)
        samples = torch.tensor(self.samples, dtype=torch.float64).to(self.device, non_blocking=True)
        steps = torch.tensor(self.steps, dtype=torch.float64).to(self.device, non_blocking=True)
        finite = torch.isfinite(losses)
        first_bad = torch.where(finite, math.inf, steps).min() if n else torch.tensor(math.inf, device=self.device)
        tokens = torch.tensor(float(self.tokens), dtype=torch.float64, device=self.device)
        if self.device_tokens is not None:
            tokens = tokens + self.device_tokens.double()
        sums = torch.stack([losses.sum(), weights.sum(), samples.sum(), tokens])
        self.samples, self.steps, self.tokens, self.device_tokens = [], [], 0, None
        return sums, first_bad.reshape(1)
