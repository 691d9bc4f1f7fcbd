"""The training loss, samples and tokens since the last log, kept off the step's critical path: per micro-batch two
numbers written on the device; sums, the non-finite check and the host sync once per log interval (`totals()`)."""

from __future__ import annotations

import math

import torch

from ddplab.errors import RunError


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

    def finite(self, step: int, ctx) -> bool:
        """Whether the loss of `step`'s micro-batches is finite on every rank (for training.nonfinite=skip)."""
        loss_sum = self.losses[self.steps.index(step) : len(self.steps), 0].sum()
        return ctx.all_reduce((~torch.isfinite(loss_sum)).float().reshape(1), "max").item() == 0

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

    def reduce(self, ctx, log_every: int, asked: bool) -> list[float]:
        """(loss sum, what it is a sum over, samples, tokens) since the last log over every rank, and whether any
        rank `asked` (a callback's stop request rides along): the loop's one host sync. A non-finite loss of any
        micro-batch on any rank ends the run (training.nonfinite=stop; skipped steps were dropped)."""
        sums, first_bad = self.totals()
        bad = ctx.all_reduce(first_bad, "min").item()
        if math.isfinite(bad):
            raise RunError(
                f"non-finite loss at step {int(bad)} (every micro-batch's loss on every rank, checked "
                f"as the train loss is logged, each logging.log_every={log_every} steps; "
                f"training.nonfinite=stop): lower training.lr, set training.clip_grad_norm, or "
                f"training.nonfinite=skip to skip such steps"
            )
        flag = torch.tensor([float(asked)], dtype=sums.dtype, device=sums.device)
        return ctx.all_reduce(torch.cat([sums, flag])).tolist()


def loss_weights(items, unpacked: list, ctx) -> tuple[list, list, str]:
    """(each micro-batch's count of the items its loss is a mean over, its loss's weight, metrics.json's loss_average):
    weight = count x world size / the step's count over every rank, so that DDP's average over ranks is the global
    mean's gradient (one all-reduce a step, no host sync). None where the loss is a mean over samples (Task.items):
    DDP's average of the ranks' means is then the global mean already."""
    counts = [items(target) for _, target, _ in unpacked]
    if any(c is None for c in counts):
        target = unpacked[0][1]
        many = isinstance(target, torch.Tensor) and target.dim() >= 2  # verify names it as a cause
        return [], [], "samples, each with many targets" if many else "samples"
    total = ctx.all_reduce(torch.stack(counts).sum().float().reshape(1)).clamp_min(1)
    return counts, [c * ctx.world_size / total[0] for c in counts], "items"
