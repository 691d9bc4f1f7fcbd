"""Optimizer, learning-rate schedule and world-size scaling of the learning rate.

training.optimizer: one of ddplab's recipes, any torch.optim class or the user's `(cfg, model) -> optimizer`;
training.schedule: one of ddplab's schedules or the user's `(cfg, optimizer, total_steps) -> LR scheduler`. The
builders take the training section and the job (what a workload function gets), handed to user code as `cfg`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import replace

import torch

from ddplab.errors import UserError
from ddplab.workload import BuildConfig, Options, is_reference, resolve


def scaled_lr(lr: float, rule: str, world_size: int) -> float:
    """`linear`: lr x world size (Goyal et al.); `sqrt`: lr x sqrt(world size) (Krizhevsky)."""
    return lr * {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[rule]


def adamw_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices, not biases, norms or other vectors (the usual transformer recipe)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _adamw(model: torch.nn.Module, t, lr: float, device: torch.device | None) -> torch.optim.Optimizer:
    # The fused kernel: one pass over all parameters instead of a loop of small ops per tensor.
    # On CPU the optimizer step itself is about 10x faster (4 M parameters); the gain in a whole
    # step grows with the parameter count (docs/benchmarks.md: speed_defaults, overhead).
    options = {"betas": (0.9, 0.95), "fused": device is None or device.type in ("cpu", "cuda"), **t.optimizer_options}
    return torch.optim.AdamW(adamw_groups(model, t.weight_decay), lr=lr, **options)


def _sgd(model: torch.nn.Module, t, lr: float, device: torch.device | None) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    options = {"momentum": t.momentum, "weight_decay": t.weight_decay, **t.optimizer_options}
    return torch.optim.SGD(params, lr=lr, **options)


OPTIMIZERS = {"adamw": _adamw, "sgd": _sgd}  # ddplab's recipes; every other torch.optim class by its own name
SCHEDULES = ("cosine", "linear", "constant")  # warm-up, then these: Schedule below


def torch_optimizer(name: str) -> type | None:
    """The torch.optim class of that name (any case), or None."""
    found = {
        n.lower(): c
        for n, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    }
    return found.get(name.lower())


def check_names(t) -> None:
    """training.optimizer and training.schedule name something that exists (imports a code reference)."""
    if is_reference(t.optimizer):
        resolve(t.optimizer, "training.optimizer")
    else:  # its name and options, tried on one parameter (on the CPU: no job yet)
        build_optimizer(t, BuildConfig(Options({}), None), torch.nn.Linear(1, 1), t.lr)
    if is_reference(t.schedule):
        resolve(t.schedule, "training.schedule")
    elif t.schedule not in SCHEDULES:
        raise UserError(
            f"training.schedule: unknown schedule '{t.schedule}'; choose one of {', '.join(SCHEDULES)} "
            f"or your own file.py:function"
        )


def build_optimizer(t, job: BuildConfig, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """training.optimizer over `model`'s parameters at peak rate `lr` (training.lr, scaled). A user's
    function sets its groups' rates itself; training.lr_scaling multiplies them as it would training.lr."""
    if not is_reference(t.optimizer):
        try:
            if t.optimizer in OPTIMIZERS:
                return OPTIMIZERS[t.optimizer](model, t, lr, job.dist and job.dist.device)
            cls = torch_optimizer(t.optimizer)
            if cls is None:
                raise UserError(
                    f"training.optimizer: unknown optimizer '{t.optimizer}'; choose one of {', '.join(OPTIMIZERS)}, "
                    f"a torch.optim class (Adam, RMSprop, Adagrad, ...) or your own file.py:function"
                )
            decay = {"weight_decay": t.weight_decay} if "weight_decay" in inspect.signature(cls).parameters else {}
            return cls([p for p in model.parameters() if p.requires_grad], lr=lr, **{**decay, **t.optimizer_options})
        except (TypeError, ValueError) as exc:
            raise UserError(
                f"training.optimizer_options {t.optimizer_options}: training.optimizer={t.optimizer} "
                f"refused them ({exc})"
            ) from None
    optimizer = resolve(t.optimizer, "training.optimizer")(replace(job, options=Options(t.optimizer_options)), model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserError(
            f"training.optimizer: {t.optimizer} returned a {type(optimizer).__name__}, not a torch.optim.Optimizer"
        )
    for group in optimizer.param_groups:
        group["lr"] *= lr / t.lr
    return optimizer


def build_schedule(t, job: BuildConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    """ddplab's warm-up + schedule, or the user's scheduler over `total_steps` (stepped once per optimizer step)."""
    if not is_reference(t.schedule):
        return Schedule(optimizer, t, total_steps)
    options = replace(job, options=Options(t.schedule_options))
    scheduler = resolve(t.schedule, "training.schedule")(options, optimizer, total_steps)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise UserError(
            f"training.schedule: {t.schedule} returned a {type(scheduler).__name__}, "
            f"not a torch.optim.lr_scheduler scheduler"
        )
    return scheduler


def lr_lambda(step: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at `step`: linear warm-up, then cosine / linear / constant."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose state is plain numbers, so snapshots load with weights_only=True. `total`, the step at which
    it reaches its floor, starts at the configured steps; a time budget moves it (replan); a resume keeps it."""

    def __init__(self, optimizer: torch.optim.Optimizer, t, total_steps: int) -> None:
        self.warmup, self.total, self.kind, self.min_ratio = t.warmup_steps, total_steps, t.schedule, t.min_lr_ratio
        self.planned = total_steps  # from epochs / max_steps: a budget can shorten the plan, never lengthen it
        super().__init__(optimizer, self._multiplier)

    def _multiplier(self, step: int) -> float:
        return lr_lambda(step, self.warmup, self.total, self.kind, self.min_ratio)

    def replan(self, total_steps: int) -> None:
        """Reach the floor at `total_steps` instead (at most the configured plan, and at least
        one step beyond the current one); the current learning rate follows at once."""
        self.total = max(min(int(total_steps), self.planned), self.last_epoch + 1)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=False):
            group["lr"] = base * self._multiplier(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def plan(self, total_steps: int) -> None:
        """The configured plan itself moves to `total_steps` (a stream's epochs measured at another length
        than planned); a time budget may shorten it again."""
        self.planned = max(int(total_steps), self.last_epoch + 1)
        self.replan(self.planned)

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("last_epoch", "base_lrs", "_last_lr", "total", "planned")}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch = state["last_epoch"]
        self.base_lrs = state["base_lrs"]
        self._last_lr = state["_last_lr"]  # the optimizer's own state restores each group's lr
        # A budget's plan carries over; the configured plan is this run's own (another world size, other steps).
        if state["total"] != state["planned"]:
            self.total = min(state["total"], self.planned)


def budget_total_steps(step: int, elapsed_s: float, budget_s: float) -> int:
    """The step at which `budget_s` runs out, at the mean pace so far (evaluation and snapshots
    included, as the budget counts them)."""
    if step <= 0 or elapsed_s <= 0:
        raise ValueError("no step measured yet")
    return step + max(0, math.ceil((budget_s - elapsed_s) / (elapsed_s / step)))


def plan_for_budget(scheduler: Schedule, ctx, step: int, elapsed_s: float, budget_s: float | None) -> None:
    """At a log interval: plan ddplab's own schedule over the steps the budget allows, at the slowest rank's pace
    (one all-reduce), so all ranks hold the same plan and learning rate; a user's keeps the plan it was built with."""
    if budget_s is None or step <= 0 or not isinstance(scheduler, Schedule) or scheduler.kind == "constant":
        return
    slowest = ctx.all_reduce(torch.tensor([float(elapsed_s)], dtype=torch.float64, device=ctx.device), "max").item()
    if slowest > 0:
        scheduler.replan(budget_total_steps(step, slowest, budget_s))
