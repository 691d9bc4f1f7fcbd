"""Exact, global evaluation metrics, one evaluator per task: each rank sums over its own shard (no padding),
and one all-reduce at the end makes the sums global, so every sample counts once whatever the world size."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class LMEvaluator:
    """Token-level cross-entropy, perplexity and next-token accuracy."""

    def __init__(self, task, device: torch.device) -> None:
        self.scored = task.scored  # (output, target) -> flat logits and their next tokens (LanguageModeling.scored)
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, tokens, correct

    def update(self, output, target: torch.Tensor) -> None:
        flat, target = self.scored(output, target)
        loss = F.cross_entropy(flat, target, reduction="sum")  # targets of -100 are left out (ignore_index)
        kept = target != -100
        correct = (flat.argmax(-1) == target)[kept].sum()
        self.sums += torch.stack([loss.double(), kept.sum().double(), correct.double()])

    def compute(self, ctx) -> dict[str, float]:
        loss_sum, tokens, correct = ctx.all_reduce(self.sums.clone()).tolist()
        if tokens == 0:
            return {}
        loss = loss_sum / tokens
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": correct / tokens, "samples": tokens}


class ClassificationEvaluator:
    """Loss, accuracy, top-5 accuracy, macro precision / recall / F1 from a global confusion matrix."""

    def __init__(self, task, device: torch.device) -> None:
        num_classes = self.num_classes = task.num_classes
        self.logits = task.logits  # the model's output -> its logits (Task.logits)
        self.confusion = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device)
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, count, top5 correct
        self.global_confusion: torch.Tensor | None = None  # rows: true class, columns: predicted; set by compute()

    def update(self, output, target: torch.Tensor) -> None:
        logits = self.logits(output).float()
        loss = F.cross_entropy(logits, target, reduction="sum")
        c = self.num_classes
        self.confusion += torch.bincount(target * c + logits.argmax(-1), minlength=c * c).view(c, c).double()
        top5 = (logits.topk(min(5, c), dim=-1).indices == target[:, None]).any(-1).sum()
        self.sums += torch.stack(
            [loss.double(), torch.tensor(len(target), device=loss.device, dtype=torch.float64), top5.double()]
        )

    def compute(self, ctx) -> dict[str, float]:
        confusion = ctx.all_reduce(self.confusion.clone())
        self.global_confusion = confusion.cpu()  # the same on every rank: reduced once, kept for the run folder
        loss_sum, count, top5 = ctx.all_reduce(self.sums.clone()).tolist()
        if count == 0:
            return {}
        out = {"loss": loss_sum / count, "samples": count, **scores_from_confusion(confusion)}
        if self.num_classes > 5:
            out["top5_accuracy"] = top5 / count
        return out


def _per_class(confusion: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Precision, recall, F1 of each class, predicted and actual counts (zero_division=0)."""
    tp, predicted, actual = confusion.diag(), confusion.sum(0), confusion.sum(1)
    # A zero denominator has a zero numerator: 0/0 is NaN, and zero_division=0 makes it 0.
    precision, recall = (tp / predicted).nan_to_num(), (tp / actual).nan_to_num()
    f1 = (2 * precision * recall / (precision + recall)).nan_to_num()
    return precision, recall, f1, predicted, actual


def per_class_scores(confusion: torch.Tensor) -> dict[str, list[float]]:
    """Precision, recall and F1 of each class and its support, as scikit-learn's
    precision_recall_fscore_support(average=None, zero_division=0) gives them."""
    precision, recall, f1, _, actual = _per_class(confusion.double())
    scores = {"precision": precision, "recall": recall, "f1": f1, "support": actual.long()}
    return {name: s.tolist() for name, s in scores.items()}


def scores_from_confusion(confusion: torch.Tensor) -> dict[str, float]:
    """Accuracy and macro precision / recall / F1 as scikit-learn defines them
    (zero_division=0; macro averages over the classes present in targets or predictions)."""
    precision, recall, f1, predicted, actual = _per_class(confusion)
    present = (predicted + actual) > 0
    return {
        "accuracy": (confusion.diag().sum() / confusion.sum()).item(),
        **{name: s[present].mean().item() for name, s in (("precision", precision), ("recall", recall), ("f1", f1))},
    }


class RegressionEvaluator:
    """A ddplab.Regression's exact sums per output, one all-reduce: n, sum e, sum |e|, sum e^2, sum y, sum y^2."""

    def __init__(self, task, device: torch.device) -> None:
        self.task = task
        self.sums = torch.zeros(6, task.outputs, dtype=torch.float64, device=device)

    def update(self, output, target) -> None:
        out, tgt = (t.double() for t in self.task._shaped(output, target))
        err = out - tgt
        self.sums += torch.stack(
            [torch.ones_like(tgt).sum(0), err.sum(0), err.abs().sum(0), (err**2).sum(0), tgt.sum(0), (tgt**2).sum(0)]
        )

    def compute(self, ctx) -> dict[str, float]:
        n, _, abs_err, sq_err, y, y2 = ctx.all_reduce(self.sums.clone())
        count = n[0].item()
        if count == 0:
            return {}
        total = y2 - y**2 / n  # sum of squares around each output's mean
        r2 = torch.where(total > 0, 1 - sq_err / total.clamp(min=1e-300), torch.zeros_like(total))
        mse = (sq_err / n).mean().item()
        return {
            "loss": mse,
            "mae": (abs_err / n).mean().item(),
            "rmse": math.sqrt(mse) if self.task.outputs == 1 else (sq_err / n).sqrt().mean().item(),
            "r2": r2.mean().item(),
            "samples": count,
        }


class MetricsEvaluator:
    """A user's ddplab.Task: its loss summed exactly, its torchmetrics synced across ranks by torchmetrics."""

    def __init__(self, task, device: torch.device) -> None:
        self.task = task
        self.items = task.items  # evaluation sets tasks.item_counter's, which knows the model
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, what it sums over, samples
        self.metrics = {name: m.to(device) for name, m in task.metrics().items()}

    def update(self, output, target) -> None:
        n = len(target)
        count = self.items(target)  # the loss is a mean over these (Task.items), else over samples
        weight = count.double() if count is not None else torch.tensor(n, dtype=torch.float64, device=self.sums.device)
        samples = torch.tensor(n, dtype=torch.float64, device=self.sums.device)
        self.sums += torch.stack([self.task.loss(output, target).double() * weight, weight, samples])
        if self.metrics:
            logits = self.task.logits(output)
            for metric in self.metrics.values():
                metric.update(logits, target)

    def compute(self, ctx) -> dict[str, float]:
        loss_sum, weight, count = ctx.all_reduce(self.sums.clone()).tolist()
        if count == 0:
            return {}
        out = {"loss": loss_sum / weight if weight else math.nan, "samples": count}
        for name, metric in self.metrics.items():
            value = metric.compute()  # torchmetrics gathers every rank's state when a process group exists
            out[name] = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            metric.reset()
        return out
