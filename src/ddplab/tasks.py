"""Tasks: what a model's output means. A task gives the loss, the tokens a batch holds, and an
evaluator whose numbers are global (every validation sample counted once across ranks).

Built in: Classification, LanguageModeling, Regression. A user subclasses Task, writes `loss`,
and lists torchmetrics objects in `metrics()`; ddplab syncs them across ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ddplab.errors import UserError


def call_model(model: torch.nn.Module, inputs) -> torch.Tensor:
    """Tensor inputs go positionally, dict inputs as keywords; HF outputs give their logits."""
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return out.logits if hasattr(out, "logits") else out


def to_device(obj, device: torch.device):
    non_blocking = device.type == "cuda"
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


class Task:
    """Subclass and write `loss`; optionally `metrics` (torchmetrics objects, computed globally)."""

    kind = "custom"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.loss(output, target) is not written")

    def metrics(self) -> dict:
        """name -> torchmetrics.Metric, each updated with (output, target); columns val_<name>."""
        return {}

    def tokens(self, inputs, target) -> int | torch.Tensor:
        """Tokens in a batch, for tokens/s (0: not a token task)."""
        return 0

    def check_output(self, output: torch.Tensor, target: torch.Tensor) -> None:
        """Raise UserError when the model's output cannot be scored by this task."""

    def evaluator(self, device: torch.device):
        return MetricsEvaluator(self, device)

    def describe(self) -> dict:
        """Plain values stored in checkpoints, from which `restore` rebuilds the task."""
        return {"kind": self.kind, "class": f"{type(self).__module__}:{type(self).__qualname__}"}


class Classification(Task):
    kind = "classification"

    def __init__(self, num_classes: int, class_names: list[str] | None = None) -> None:
        if not isinstance(num_classes, int) or num_classes < 2:
            raise UserError(f"Classification(num_classes={num_classes!r}): needs an integer >= 2")
        if class_names is not None and len(class_names) != num_classes:
            raise UserError(f"Classification: {len(class_names)} class_names for {num_classes} classes")
        self.num_classes = num_classes
        self.class_names = [str(n) for n in class_names] if class_names is not None else None

    def loss(self, output, target):
        return F.cross_entropy(output.float(), target)

    def tokens(self, inputs, target):
        if isinstance(inputs, dict) and "attention_mask" in inputs:
            return inputs["attention_mask"].sum()
        if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point():
            return inputs.numel()
        return 0

    def check_output(self, output, target):
        expected = (len(target), self.num_classes)
        if tuple(output.shape) != expected:
            raise UserError(f"the model's output has shape {tuple(output.shape)} but Classification({self.num_classes}) "
                            f"needs {expected} (one logit per class)")

    def evaluator(self, device):
        from ddplab.metrics.evaluation import ClassificationEvaluator

        return ClassificationEvaluator(self.num_classes, device)

    def describe(self):
        return {"kind": self.kind, "num_classes": self.num_classes, "class_names": self.class_names}


class LanguageModeling(Task):
    kind = "lm"

    def __init__(self, vocab_size: int | None = None) -> None:
        self.vocab_size = vocab_size

    def loss(self, output, target):
        return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())

    def tokens(self, inputs, target):
        return target.numel()

    def check_output(self, output, target):
        if output.dim() != 3 or tuple(output.shape[:2]) != tuple(target.shape):
            raise UserError(f"the model's output has shape {tuple(output.shape)} but LanguageModeling needs "
                            f"(batch, time, vocab) matching targets of shape {tuple(target.shape)}")

    def evaluator(self, device):
        from ddplab.metrics.evaluation import LMEvaluator

        return LMEvaluator(device)

    def describe(self):
        return {"kind": self.kind, "vocab_size": self.vocab_size}


class Regression(Task):
    """Mean squared error; global MAE, RMSE and R² (averaged over outputs) as val_mae, val_rmse, val_r2."""

    kind = "regression"

    def __init__(self, outputs: int = 1) -> None:
        if not isinstance(outputs, int) or outputs < 1:
            raise UserError(f"Regression(outputs={outputs!r}): needs an integer >= 1")
        self.outputs = outputs

    def _shaped(self, output, target):
        return output.float().reshape(len(target), -1), target.float().reshape(len(target), -1)

    def loss(self, output, target):
        out, tgt = self._shaped(output, target)
        return F.mse_loss(out, tgt)

    def check_output(self, output, target):
        n = len(target)
        fits = tuple(output.shape) in ((n, self.outputs),) + (((n,),) if self.outputs == 1 else ())
        if not fits:
            want = f"({n}, {self.outputs})" + (f" or ({n},)" if self.outputs == 1 else "")
            raise UserError(f"the model's output has shape {tuple(output.shape)} but Regression(outputs={self.outputs}) "
                            f"needs {want}")
        if target.numel() != n * self.outputs:
            raise UserError(f"targets of shape {tuple(target.shape)} do not hold {self.outputs} value(s) per sample "
                            f"for Regression(outputs={self.outputs})")

    def evaluator(self, device):
        return RegressionEvaluator(self, device)

    def describe(self):
        return {"kind": self.kind, "outputs": self.outputs}


def restore(info: dict | str | None, num_classes: int | None = None, vocab_size: int | None = None) -> Task:
    """The task a checkpoint describes (older checkpoints stored only its kind as a string)."""
    if isinstance(info, str) or info is None:
        info = {"kind": info or "lm", "num_classes": num_classes, "vocab_size": vocab_size}
    kind = info.get("kind")
    if kind == "classification":
        return Classification(info["num_classes"], info.get("class_names"))
    if kind == "lm":
        return LanguageModeling(info.get("vocab_size"))
    if kind == "regression":
        return Regression(info.get("outputs", 1))
    return Task()


# ---------------------------------------------------------------------------- evaluators

class RegressionEvaluator:
    """Exact sums per output, one all-reduce: n, sum e, sum |e|, sum e^2, sum y, sum y^2."""

    def __init__(self, task: Regression, device: torch.device) -> None:
        self.task = task
        self.sums = torch.zeros(6, task.outputs, dtype=torch.float64, device=device)

    def update(self, output, target) -> None:
        out, tgt = self.task._shaped(output, target)
        out, tgt = out.double(), tgt.double()
        err = out - tgt
        ones = torch.ones_like(tgt)
        self.sums += torch.stack([ones.sum(0), err.sum(0), err.abs().sum(0), (err ** 2).sum(0), tgt.sum(0),
                                  (tgt ** 2).sum(0)])

    def compute(self, ctx) -> dict[str, float]:
        n, _, abs_err, sq_err, y, y2 = ctx.all_reduce(self.sums.clone())
        count = n[0].item()
        if count == 0:
            return {}
        total = y2 - y ** 2 / n  # sum of squares around each output's mean
        r2 = torch.where(total > 0, 1 - sq_err / total.clamp(min=1e-300), torch.zeros_like(total))
        mse = (sq_err / n).mean().item()
        return {"loss": mse, "mae": (abs_err / n).mean().item(), "rmse": math.sqrt(mse) if self.task.outputs == 1
                else (sq_err / n).sqrt().mean().item(), "r2": r2.mean().item(), "samples": count}


class MetricsEvaluator:
    """A user task: its loss summed exactly, its torchmetrics synced across ranks by torchmetrics."""

    def __init__(self, task: Task, device: torch.device) -> None:
        self.task = task
        self.sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, samples
        self.metrics = {name: m.to(device) for name, m in task.metrics().items()}

    def update(self, output, target) -> None:
        n = len(target)
        self.sums += torch.stack([self.task.loss(output, target).double() * n,
                                  torch.tensor(n, dtype=torch.float64, device=self.sums.device)])
        for metric in self.metrics.values():
            metric.update(output, target)

    def compute(self, ctx) -> dict[str, float]:
        loss_sum, count = ctx.all_reduce(self.sums.clone()).tolist()
        if count == 0:
            return {}
        out = {"loss": loss_sum / count, "samples": count}
        for name, metric in self.metrics.items():
            value = metric.compute()  # torchmetrics gathers every rank's state when a process group exists
            out[name] = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            metric.reset()
        return out
