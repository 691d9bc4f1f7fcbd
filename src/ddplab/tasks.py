"""Tasks: what a model's output means: the loss, the tokens a batch holds, an evaluator whose numbers are
global, and what `ddplab predict` prints for one input (docs/your-workload.md#tasks).

A loss that is a mean over items inside a sample (tokens; targets of -100 left out) is averaged over the
global count of those items (`Task.items`, summed over every process and accumulation step): the model's own
mean loss times its count is its summed loss exactly, whatever the loss, with no second pass over the logits
(Hugging Face's `num_items_in_batch` is taken by some models only). `items` None: a mean over samples.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ddplab.errors import UserError
from ddplab.evaluators import ClassificationEvaluator, LMEvaluator, MetricsEvaluator, RegressionEvaluator


def call_model(model: torch.nn.Module, inputs):
    """The output exactly as the model returns it: tensor inputs go positionally, mapping inputs as keywords."""
    return model(**inputs) if isinstance(inputs, Mapping) else model(inputs)


def own_loss(output) -> torch.Tensor | None:
    """The loss a model computed itself (`.loss`, `["loss"]`), or None."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def find_logits(output) -> torch.Tensor:
    """The tensor, `.logits`, `["logits"]` or the first element (as in `(logits, loss)`)."""
    found = output
    if not isinstance(found, torch.Tensor) and hasattr(found, "logits"):  # HF's ModelOutput, before its dict view
        found = found.logits
    elif isinstance(found, dict):
        found = found.get("logits")
    elif isinstance(found, (tuple, list)) and found:
        found = found[0]
    if not isinstance(found, torch.Tensor):
        raise UserError(
            f"model: the forward pass returned {_kind(output)}; the task needs logits: a tensor, "
            f"(logits, ...), {{'logits': ...}} or an object with .logits"
        )
    return found


def _kind(output) -> str:
    if isinstance(output, dict):
        return f"a dict with keys {sorted(map(str, output))[:5]}"
    if isinstance(output, (tuple, list)):
        first = type(output[0]).__name__ if output else "nothing"
        return f"a {type(output).__name__} of {len(output)} starting with {first}"
    return f"a {type(output).__name__}"


def to_device(obj, device: torch.device):
    if isinstance(obj, Mapping):  # a dict, HF's BatchEncoding
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    if callable(getattr(obj, "to", None)):  # a tensor, or a batch that moves itself (JPEGs decoded on the GPU)
        return obj.to(device, non_blocking=device.type == "cuda")
    return obj


class Task:
    """Subclass and write `loss`; optionally `metrics` (torchmetrics objects, computed globally)
    and `predict` (what `ddplab predict` prints)."""

    kind = "custom"
    target_field: str | None = None  # where a mapping batch holds its target; None: `labels`, else `label`
    scorer: type = MetricsEvaluator  # what `evaluator` makes: (task, device) -> global scores

    def unpack(self, batch) -> tuple:
        """(inputs, target, samples) of one collated batch. A mapping is the inputs whole, its target
        field included (an HF model computes its loss from `labels`)."""
        if isinstance(batch, Mapping):
            names = (self.target_field,) if self.target_field else ("labels", "label")
            field = next((n for n in names if n in batch), None)
            if field is None:
                raise UserError(
                    f"a batch is a mapping with keys {sorted(map(str, batch))[:8]} but no target "
                    f"field {' or '.join(names)}; set {type(self).__name__}.target_field"
                )
            return batch, batch[field], len(batch[field])
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1], len(batch[1])
        raise UserError(
            f"a batch is {_kind(batch)}; ddplab takes (inputs, target) or a mapping with a "
            f"'labels' field (see docs/your-workload.md)"
        )

    def loss(self, output, target: torch.Tensor) -> torch.Tensor:
        """A scalar tensor, from the model's output exactly as returned: here the model's own loss."""
        if (loss := own_loss(output)) is not None:
            return loss
        raise NotImplementedError(
            f"{type(self).__name__}.loss(output, target) is not written, and the model's output holds no loss"
        )

    def logits(self, output) -> torch.Tensor:
        """The tensor scored by metrics and predict; override for an output of another form."""
        return find_logits(output)

    def metrics(self) -> dict:
        """name -> torchmetrics.Metric, each updated with (logits, target); columns val_<name>."""
        return {}

    def infer(self, model: torch.nn.Module, inputs):
        """What `ddplab predict` runs on a batch's inputs (never a target), handing its result to `predict` as
        `output`: here the forward pass; a seq2seq task returns `model.generate(**inputs)`."""
        return call_model(model, inputs)

    def predict(self, output, top_k: int = 1) -> list[dict]:
        """One row (name -> value) per input of a batch; here the logits of each, as a list."""
        return [{"output": row.tolist()} for row in self.logits(output).float().cpu()]

    def tokens(self, inputs, target) -> int | torch.Tensor:
        """Tokens in a batch, for tokens/s (0: not a token task)."""
        return 0

    def items(self, target) -> torch.Tensor | None:
        """How many items of this batch the loss is a mean over (None: a mean over samples). Here: integer
        targets of one or more values per sample (token labels) count their entries that are not -100."""
        if isinstance(target, torch.Tensor) and target.dim() >= 2 and not target.is_floating_point():
            return (target != -100).sum()
        return None

    def check_output(self, output, target: torch.Tensor) -> None:
        """Raise UserError when the model's output cannot be scored by this task."""

    def evaluator(self, device: torch.device):
        return self.scorer(self, device)

    def describe(self) -> dict:
        """Plain values stored in checkpoints, from which `restore` rebuilds the task."""
        return {"kind": self.kind, "class": f"{type(self).__module__}:{type(self).__qualname__}"}


def item_counter(task: Task, model: torch.nn.Module):
    """`task.items`, but the count of `labels[:, 1:]` for a Hugging Face decoder-only LM counted as Task does by
    default: it scores `labels` shifted by one, dropping each sequence's first."""
    config, can_generate = getattr(model, "config", None), getattr(model, "can_generate", None)
    shifts = callable(can_generate) and not getattr(config, "is_encoder_decoder", True) and can_generate()
    if type(task).items is not Task.items or not shifts:
        return task.items
    return lambda target: task.items(
        target[:, 1:] if isinstance(target, torch.Tensor) and target.dim() >= 2 else target
    )


def per_sample(self, target) -> None:
    """`Task.items` of a loss that is a mean over samples."""
    return None


class Classification(Task):
    kind = "classification"
    scorer = ClassificationEvaluator
    items = per_sample

    def __init__(self, num_classes: int, class_names: list[str] | None = None) -> None:
        if not isinstance(num_classes, int) or num_classes < 2:
            raise UserError(f"Classification(num_classes={num_classes!r}): needs an integer >= 2")
        if class_names is not None and len(class_names) != num_classes:
            raise UserError(f"Classification: {len(class_names)} class_names for {num_classes} classes")
        self.num_classes = num_classes
        self.class_names = [str(n) for n in class_names] if class_names is not None else None

    def loss(self, output, target):
        own = own_loss(output)
        return own if own is not None else F.cross_entropy(self.logits(output).float(), target)

    def tokens(self, inputs, target):
        if isinstance(inputs, Mapping) and "attention_mask" in inputs:
            return inputs["attention_mask"].sum()
        if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point():
            return inputs.numel()
        return 0

    def check_output(self, output, target):
        expected, shape = (len(target), self.num_classes), tuple(self.logits(output).shape)
        if shape != expected:
            raise UserError(
                f"the model's logits have shape {shape} but Classification({self.num_classes}) "
                f"needs {expected} (one logit per class)"
            )

    def predict(self, output, top_k: int = 1):
        """The best label and its probability; with top_k > 1, label_1, probability_1, label_2, ..."""
        if top_k > self.num_classes:
            raise UserError(f"--top-k {top_k}: this classifier has {self.num_classes} classes")
        names = self.class_names or [str(i) for i in range(self.num_classes)]
        probs, idx = torch.softmax(self.logits(output).float(), dim=-1).topk(top_k, dim=-1)
        rows: list[dict] = [{} for _ in idx]
        for row, p, i in zip(rows, probs.tolist(), idx.tolist(), strict=True):
            for r in range(top_k):
                suffix = f"_{r + 1}" if top_k > 1 else ""
                row[f"label{suffix}"], row[f"probability{suffix}"] = names[i[r]], p[r]
        return rows

    def describe(self):
        return {"kind": self.kind, "num_classes": self.num_classes, "class_names": self.class_names}


CONTINUES_TEXT = "this run holds a language model, which continues text: use `ddplab generate RUN --prompt TEXT`"


class LanguageModeling(Task):
    """Targets are the next tokens (`shift=False`), or the inputs themselves (`shift=True`, as Hugging Face
    causal LMs have them, scored against the logits one position earlier). Targets of -100 are not scored."""

    kind = "lm"
    scorer = LMEvaluator

    def __init__(self, vocab_size: int | None = None, shift: bool = False) -> None:
        self.vocab_size, self.shift = vocab_size, shift

    def scored(self, output, target) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, targets), flat, aligned: the next token of each position."""
        logits = self.logits(output)
        if self.shift:
            logits, target = logits[:, :-1], target[:, 1:]
        return logits.flatten(0, 1).float(), target.flatten()

    def loss(self, output, target):
        own = own_loss(output)  # an HF causal LM shifts its labels itself
        return own if own is not None else F.cross_entropy(*self.scored(output, target))

    def tokens(self, inputs, target):
        return (target != -100).sum()

    def items(self, target):
        """The targets scored: shifted ones lose each sequence's first (an HF causal LM shifts them itself)."""
        return ((target[:, 1:] if self.shift else target) != -100).sum()

    def check_output(self, output, target):
        logits = self.logits(output)
        if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(target.shape):
            raise UserError(
                f"the model's logits have shape {tuple(logits.shape)} but LanguageModeling needs "
                f"(batch, time, vocab) matching targets of shape {tuple(target.shape)}"
            )

    def predict(self, output, top_k: int = 1):
        raise UserError(CONTINUES_TEXT)

    def describe(self):
        return {"kind": self.kind, "vocab_size": self.vocab_size, "shift": self.shift}


class Regression(Task):
    """Mean squared error; global MAE, RMSE and R² (averaged over outputs) as val_mae, val_rmse, val_r2."""

    kind = "regression"
    scorer = RegressionEvaluator
    items = per_sample

    def __init__(self, outputs: int = 1) -> None:
        if not isinstance(outputs, int) or outputs < 1:
            raise UserError(f"Regression(outputs={outputs!r}): needs an integer >= 1")
        self.outputs = outputs

    def _shaped(self, output, target):
        return self.logits(output).float().reshape(len(target), -1), target.float().reshape(len(target), -1)

    def loss(self, output, target):
        own = own_loss(output)
        return own if own is not None else F.mse_loss(*self._shaped(output, target))

    def check_output(self, output, target):
        n, shape = len(target), tuple(self.logits(output).shape)
        if shape != (n, self.outputs) and not (self.outputs == 1 and shape == (n,)):
            want = f"({n}, {self.outputs})" + (f" or ({n},)" if self.outputs == 1 else "")
            raise UserError(f"the model's output has shape {shape} but Regression(outputs={self.outputs}) needs {want}")
        if target.numel() != n * self.outputs:
            raise UserError(
                f"targets of shape {tuple(target.shape)} do not hold {self.outputs} value(s) per sample "
                f"for Regression(outputs={self.outputs})"
            )

    def predict(self, output, top_k: int = 1):
        """The predicted value (value_1, value_2, ... for several outputs)."""
        values = self.logits(output).float().reshape(-1, self.outputs).tolist()
        if self.outputs == 1:
            return [{"value": row[0]} for row in values]
        return [{f"value_{i + 1}": v for i, v in enumerate(row)} for row in values]

    def describe(self):
        return {"kind": self.kind, "outputs": self.outputs}


KINDS = {"classification": Classification, "lm": LanguageModeling, "regression": Regression}


def restore(info: dict | None) -> Task:
    """The task a checkpoint describes (`describe()`: its kind and its arguments); a plain Task for a checkpoint
    file that describes none."""
    args = dict(info or {})
    built_in = KINDS.get(args.pop("kind", None))
    return built_in(**args) if built_in is not None else Task()
