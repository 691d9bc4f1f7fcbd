"""Building a workload's data and model, and checking what user code hands back, before any
byte is written to a run folder."""

from __future__ import annotations

import contextlib

import torch
from torch.utils.data import Dataset, Subset

from ddplab.errors import RunError, UserError, first_line
from ddplab.tasks import Task, call_model
from ddplab.workload import Data, Workload, build_config
from ddplab.distributed import wrap_model
from ddplab.engine import fsdp_comm
from ddplab.engine.comm import install_comm_hook
from ddplab.engine.heartbeat import place_of
from ddplab.engine.sharding import shard


def distribute(model: torch.nn.Module, cfg, ctx):
    """(the model to train, the monitor of its gradient communication or None): in channels_last where it pays,
    DDP-wrapped with the comm hook when distributed, or sharded (distributed.strategy); compiled when asked."""
    if wants_channels_last(model, cfg.training.channels_last, ctx.device):
        # Before DDP, which lays out its gradient buckets by the parameters' strides. A state dict holds the
        # same values in either format (load_state_dict copies), so checkpoints and predict are unaffected.
        model.to(memory_format=torch.channels_last)
        model.register_forward_pre_hook(_inputs_channels_last, with_kwargs=True)
    if cfg.distributed.strategy != "ddp":
        wrapped = shard(model, cfg, ctx)
        comm = fsdp_comm.install(wrapped, ctx.device, getattr(ctx, "beat", None)) if ctx.is_distributed else None
    else:
        wrapped = wrap_model(model, ctx, bucket_cap_mb=cfg.distributed.bucket_cap_mb,
                             find_unused_parameters=cfg.distributed.find_unused_parameters or cfg.model.freeze)
        comm = install_comm_hook(wrapped, cfg.distributed, ctx) if ctx.is_distributed else None
    if not cfg.training.compile:
        return wrapped, comm
    compiled = torch.compile(wrapped)
    # Runs before the compiled frame: a batch dimension marked dynamic from the first step gives one graph for
    # every batch size, so the ragged last batch of each epoch finds it instead of compiling again.
    compiled.register_forward_pre_hook(_batch_dynamic, with_kwargs=True)
    return compiled, comm


def wants_channels_last(model: torch.nn.Module, setting: str, device: torch.device) -> bool:
    """training.channels_last: true, false, or auto (convolutional models on CUDA, where cuDNN's NHWC
    kernels run the tensor cores without transposes)."""
    if setting != "auto":
        return setting == "true"
    return device.type == "cuda" and any(p.dim() == 4 for m in model.modules()
                                         if isinstance(m, torch.nn.Conv2d) for p in m.parameters())


def _each_tensor(args: tuple, kwargs: dict, change) -> tuple[tuple, dict]:
    return tuple(change(a) for a in args), {k: change(v) for k, v in kwargs.items()}


def _inputs_channels_last(module, args, kwargs):
    """Image batches (4-D float tensors) in the weights' format, converted where they already are (the device)."""
    return _each_tensor(args, kwargs, lambda t: t.contiguous(memory_format=torch.channels_last)
                        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point() else t)


def _batch_dynamic(module, args, kwargs):
    def mark(t):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return t
    return _each_tensor(args, kwargs, mark)


def autocast(amp: str, device: torch.device):
    """A factory of autocast contexts for training.amp (a null context for none)."""
    dtype = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[amp]
    return contextlib.nullcontext if dtype is None else lambda: torch.autocast(device.type, dtype=dtype)


def _call(fn, where: str, *args):
    """A workload function that raises fails the start in one line naming it and the file and line that
    raised: its own UserError is bad input (exit 2), anything else a bug (exit 1, the traceback in logs/)."""
    try:
        return fn(*args)
    except (UserError, RunError):
        raise
    except Exception as exc:  # noqa: BLE001
        raise RunError(f"{where} raised {type(exc).__name__}: {first_line(exc)} at {place_of(exc)}") from exc


def build_data(cfg, ctx, work: Workload) -> Data:
    """The workload's Data, checked: what a data function hands back is the user's to fix."""
    where = f"data.name={cfg.data.name}"
    data = _call(work.data, where, build_config(cfg, "data", ctx))
    if not isinstance(data, Data):
        raise UserError(f"{where} returned {type(data).__name__}, not ddplab.Data(train=..., val=..., task=...)")
    for split in ("train", "val", "test"):
        value = getattr(data, split)
        if value is not None and not isinstance(value, Dataset):
            raise UserError(f"{where}: Data.{split} is a {type(value).__name__}, not a torch.utils.data.Dataset")
    if not isinstance(data.task, Task):
        raise UserError(f"{where}: Data.task is {data.task!r}; give ddplab.Classification(n), ddplab.Regression(), "
                        f"ddplab.LanguageModeling() or a ddplab.Task subclass")
    if len(data.train) == 0:
        raise UserError(f"{where}: the training set is empty")
    if cfg.data.limit is not None and cfg.data.limit < len(data.train):
        data.train = Subset(data.train, range(cfg.data.limit))
    return data


def build_model(cfg, ctx, work: Workload, data: Data) -> torch.nn.Module:
    """The workload's model, checked by one forward pass on two training samples."""
    model = _call(work.model, f"model.name={cfg.model.name}", build_config(cfg, "model", ctx), data)
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model.name={cfg.model.name} returned {type(model).__name__}, not a torch.nn.Module")
    check_output(model, data)
    return model


def check_output(model: torch.nn.Module, data: Data) -> None:
    """One forward pass on two training samples: an output the task cannot score, or a loss that
    is not a finite scalar tensor, fails here rather than in every worker's first step."""
    items = [data.train[i] for i in range(min(2, len(data.train)))]
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise UserError(f"data: a dataset item must be (inputs, target), got {type(item).__name__}"
                            f"{' of length ' + str(len(item)) if isinstance(item, (tuple, list)) else ''}")
    collate = data.collate_fn or torch.utils.data.default_collate
    try:
        inputs, target = collate(items)
    except Exception as exc:  # noqa: BLE001 - the user's data: say what broke, in one line
        raise UserError(f"data: two items do not collate into a batch ({type(exc).__name__}: "
                        f"{first_line(exc, 160)}); give Data(collate_fn=...)") from None
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = call_model(model, inputs)
    except Exception as exc:  # noqa: BLE001 - a bug in the model's code: exit 1, its traceback in logs/
        raise RunError(f"model: a forward pass on a batch of {len(target)} failed ({type(exc).__name__}: "
                       f"{first_line(exc, 160)}) at {place_of(exc)}") from exc
    finally:
        model.train(was_training)
    task = data.task
    _call(task.check_output, f"{type(task).__name__}.check_output(output, target)", output, target)
    where = f"{type(task).__name__}.loss(output, target)"
    with torch.no_grad():
        loss = _call(task.loss, where, output, target)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UserError(f"{where} returned {shape} on a batch of {len(target)}; it must return a scalar tensor "
                        f"(e.g. .mean())")
    if not torch.isfinite(loss):
        raise UserError(f"{where} returned {loss.item()} on the first two training samples; it must be finite")

