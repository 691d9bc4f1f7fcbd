"""Building a workload's data and model, checked before any byte is written to a run folder; distributing the model."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
import traceback
from collections.abc import Mapping
from itertools import islice
from typing import cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from ddplab.data.stream import FirstItems, is_stateful, is_stream, said_how, shards_itself, size
from ddplab.engine.diagnosis.failure import place_of
from ddplab.engine.loop.loaders import data_workers
from ddplab.engine.loop.rng import rng_state, seed_everything, set_rng_state
from ddplab.engine.parallel import fsdp_comm
from ddplab.engine.parallel.clock import InFlight
from ddplab.engine.parallel.ddp_comm import install_comm_hook
from ddplab.engine.parallel.distributed import wrap_model
from ddplab.engine.parallel.sharding import shard
from ddplab.engine.parallel.torch_internals import mark_batch_dynamic, uncompiled
from ddplab.engine.run_folder import assets as saved_assets
from ddplab.errors import RunError, UserError, first_line
from ddplab.tasks import Task, call_model
from ddplab.workload import Assets, Data, Workload, build_config

# Every dropout layer torch has (those dropout_off turns off, those the model check counts).
DROPOUT = tuple(
    getattr(torch.nn, n) for n in "Dropout Dropout1d Dropout2d Dropout3d AlphaDropout FeatureAlphaDropout".split()
)
SPLITS = ("train", "val", "test")


def distribute(model: torch.nn.Module, cfg, ctx):
    """(the model to train, the monitor of its gradient communication or None): in channels_last where it pays,
    DDP-wrapped with the comm hook when distributed, or sharded (distributed.strategy); compiled when asked."""
    if wants_channels_last(model, cfg.training.channels_last, ctx.device):
        # Before DDP, which lays out its gradient buckets by the parameters' strides. A state dict holds the
        # same values in either format (load_state_dict copies), so checkpoints and predict are unaffected.
        model.to(memory_format=torch.channels_last)
        model.register_forward_pre_hook(_each_tensor(_channels_last), with_kwargs=True)
    d = cfg.distributed
    if d.sync_batchnorm:  # in place for every BatchNorm below the root (the model is no BatchNorm)
        torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    comm: InFlight | None
    if d.strategy != "ddp":
        wrapped = shard(model, cfg, ctx)
        comm = fsdp_comm.install(wrapped, ctx.device, getattr(ctx, "beat", None)) if ctx.is_distributed else None
    else:
        unused = d.find_unused_parameters or cfg.model.freeze
        wrapped = wrap_model(model, ctx, bucket_cap_mb=d.bucket_cap_mb, find_unused_parameters=unused)
        comm = install_comm_hook(wrapped, d, ctx) if ctx.is_distributed else None
    if cfg.training.compile:
        wrapped = cast(torch.nn.Module, torch.compile(wrapped))  # compiling a Module gives a Module
        # Runs before the compiled frame: a batch dimension marked dynamic from the first step gives one graph for
        # every batch size, so the ragged last batch of each epoch finds it instead of compiling again.
        wrapped.register_forward_pre_hook(_each_tensor(_batch_dynamic), with_kwargs=True)
    return wrapped, comm


def wants_channels_last(model: torch.nn.Module, setting: str, device: torch.device) -> bool:
    """training.channels_last: true, false, or auto (convolutional models on CUDA, where cuDNN's NHWC
    kernels run the tensor cores without transposes)."""
    if setting != "auto":
        return setting == "true"
    return device.type == "cuda" and any(
        p.dim() == 4 for m in model.modules() if isinstance(m, torch.nn.Conv2d) for p in m.parameters()
    )


def _each_tensor(change):
    """A forward pre-hook that passes each positional and keyword input through `change`."""
    return lambda module, args, kwargs: (tuple(map(change, args)), {k: change(v) for k, v in kwargs.items()})


def _channels_last(t):
    """Image batches (4-D float tensors) in the weights' format, converted where they already are (the device)."""
    image = isinstance(t, torch.Tensor) and t.dim() == 4 and t.is_floating_point()
    return t.contiguous(memory_format=torch.channels_last) if image else t


def _batch_dynamic(t):
    if isinstance(t, torch.Tensor) and t.dim() > 0:
        mark_batch_dynamic(t)
    return t


def autocast(amp: str, device: torch.device):
    """A factory of autocast contexts for training.amp."""
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


def build_data(cfg, ctx, work: Workload, assets: Assets | None = None) -> Data:
    """The workload's Data, checked: what a data function hands back is the user's to fix. Given
    `assets` (predict: what the run saved), it may hand back Data without datasets, built from
    them alone (its task, where it gives none, is the saved one)."""
    where = f"data.name={cfg.data.name}"
    data = _call(work.data, where, build_config(cfg, "data", ctx, assets))
    if not isinstance(data, Data):
        raise UserError(f"{where} returned {type(data).__name__}, not ddplab.Data(train=..., val=..., task=...)")
    if assets is not None and all(split is None for split in (data.train, data.val, data.test)):
        data.task = assets.task if data.task is None else data.task
        check_task(data.task, where)
        return data
    for split in SPLITS:
        check_dataset(getattr(data, split), f"{where}: Data.{split}")
    check_task(data.task, where)
    if assets is None:
        saved_assets.check(data, where)
    n = size(data.train)
    if n is None and not cfg.training.max_steps:
        raise UserError(
            f"{where}: Data.train is a stream ({type(data.train).__name__}) that does not know its "
            f"length: set training.max_steps (the learning-rate schedule needs it), or give it a __len__"
        )
    if n == 0:
        raise UserError(f"{where}: the training set is empty")
    if cfg.data.limit is not None and n is not None and cfg.data.limit < n and not is_stream(data.train):
        data.train = Subset(data.train, range(cfg.data.limit))
    if ctx is not None:
        same_on_every_rank(
            data, ctx, where, data_workers(cfg.data.num_workers, ctx.device, ctx.launch.local_world_size)
        )
    return data


def check_task(task, where: str) -> None:
    if not isinstance(task, Task):
        raise UserError(
            f"{where}: Data.task is {task!r}; give ddplab.Classification(n), ddplab.Regression(), "
            f"ddplab.LanguageModeling() or a ddplab.Task subclass"
        )


def same_on_every_rank(data: Data, ctx, where: str, workers: int = 0) -> None:
    """Every rank must build the same data (DDP averages gradients of one dataset): a tokenizer trained
    on each rank, or a label map built from an unordered set, differ from rank to rank. Compared by a
    digest of the task, `meta`, and each split's kind, length and first items; a stream's first items
    tell whether it shards itself (sharded_how)."""
    for split in SPLITS:
        sharded_how(getattr(data, split), f"{where}: Data.{split}", ctx, workers)
    digests = ctx.gather_objects(data_digest(data))
    differ = next(((r, d) for r, d in enumerate(digests) if d != digests[0]), None)
    if differ is None:
        return
    rank, theirs = differ
    part = next(k for k in theirs if theirs[k] != digests[0][k])
    if part in SPLITS and is_stream(getattr(data, part)):
        raise UserError(
            f"{where}: Data.{part} is a stream whose length or kind differs on rank {rank} from rank 0's: "
            f"if it yields only its own process's share, set shards_itself = True on it"
        )
    what = "its task or meta" if part == "about" else f"Data.{part}: its length or first items"
    raise UserError(
        f"{where}: returns different data on rank {rank} than on rank 0 ({what} differ): build it from the "
        f"seed and the files alone, the same on every rank (e.g. rank 0 builds a tokenizer and saves it, "
        f"cfg.barrier(), every rank loads it)"
    )


def sharded_how(dataset, where: str, ctx, workers: int) -> None:
    """PyTorch leaves sharding a stream to the stream. One that does not say (its own `shards_itself`) is
    read twice on each rank: first items that differ between ranks, the same on every read, are a stream
    that shards itself; the same on every rank, one that ddplab splits. With loader workers, each worker's
    first items tell the same of workers. The finding is set as the stream's `shards_itself`."""
    if dataset is None or not is_stream(dataset) or said_how(dataset):
        return
    workers = 0 if is_stateful(dataset) else workers  # such a stream is read in the training process
    if ctx.world_size == 1 and not workers:
        return  # one reader: nothing to split
    first, again = first_items(dataset, reads=2)  # random draws go on between the reads: an unseeded order shows
    firsts = ctx.gather_objects((first, again))
    unstable = [r for r, (a, b) in enumerate(firsts) if a != b]
    if unstable:
        raise UserError(
            f"{where} is a stream whose first items change from one read to the next (rank {unstable[0]}), so "
            f"ddplab cannot tell whether it shards itself: if it yields only its own process's share, set "
            f"shards_itself = True on it; if it is one order for every process, with random augmentation, "
            f"shards_itself = False; else make its order a function of the seed and the epoch (set_epoch(epoch), "
            f"no unseeded shuffle)"
        )
    by_rank = ctx.world_size > 1 and len({a for a, _ in firsts}) > 1
    by_worker = False
    if workers > 1:
        with _same_draws():
            loader = DataLoader(FirstItems(dataset, first_items), batch_size=None, num_workers=workers)
            by_worker = any(d[0] != first for d in loader)
        by_worker = any(ctx.gather_objects(by_worker))
    if ctx.world_size > 1 and workers > 1 and by_rank != by_worker:
        split, whole = ("ranks", "loader workers") if by_rank else ("loader workers", "ranks")
        raise UserError(
            f"{where} is a stream that splits itself among {split} but not among {whole} (its first items "
            f"say so): split it by both, with torch.distributed.get_rank() and "
            f"torch.utils.data.get_worker_info(), or by neither (ddplab then splits it)"
            + (", or set data.num_workers=0" if by_rank else "")
        )
    dataset.shards_itself = by_rank or by_worker


def first_items(dataset, n: int = 4, reads: int = 1) -> list[str]:
    """Digests of the stream's first `n` items, read `reads` times in this process (a loader worker: its own),
    from the same random state on every rank."""
    digests = []
    with _same_draws():
        for _ in range(reads):
            h = hashlib.sha256()
            for item in islice(dataset, n):
                digest(item, h)
            digests.append(h.hexdigest())
    return digests


@contextlib.contextmanager
def _same_draws():
    """Random augmentations draw the same numbers on every rank, and training's draws are left as they were."""
    saved = rng_state()
    seed_everything(0)
    yield
    set_rng_state(saved)


def data_digest(data: Data) -> dict:
    """Digests of the task and `meta` (`about`), and of each split's kind, length and first items (a
    stream's first items: sharded_how compared them)."""
    plain = json.dumps([data.task.describe(), data.meta], sort_keys=True, default=lambda o: type(o).__name__)
    out = {"about": hashlib.sha256(plain.encode()).hexdigest()}
    with _same_draws():
        for split in SPLITS:
            dataset = getattr(data, split)
            own = is_stream(dataset) and shards_itself(dataset)  # its length may be its rank's own
            h = hashlib.sha256(f"{type(dataset).__name__} {None if own else size(dataset)}".encode())
            if dataset is not None and not is_stream(dataset):
                for i in range(min(2, len(dataset))):
                    digest(dataset[i], h)
            out[split] = h.hexdigest()
    return out


def digest(obj, h) -> None:
    """`obj` (tensors, arrays, plain values, and dicts and lists of them) into the hash `h`."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu().contiguous()
        h.update(str((obj.dtype, tuple(obj.shape))).encode())
        h.update(obj.view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray) and obj.dtype != object:
        h.update(f"{obj.dtype.str} {obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            digest(obj[k], h)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            digest(v, h)
    elif isinstance(obj, (str, bytes, int, float, bool, type(None))):
        h.update(repr(obj).encode())
    else:  # an image, a file handle: its repr may hold a memory address
        h.update(type(obj).__name__.encode())


ACCEPTED = (
    "a torch.utils.data.Dataset with __len__, a torch.utils.data.IterableDataset (a stream), "
    "a Hugging Face datasets.Dataset or datasets.IterableDataset"
)


def check_dataset(value, where: str) -> None:
    if value is None or is_stream(value):  # Hugging Face's IterableDataset is a torch IterableDataset
        return
    hf = sys.modules.get("datasets")  # loaded wherever a user built one of its datasets
    if hf is not None and isinstance(value, hf.Dataset):
        return
    if isinstance(value, Dataset) and size(value) is not None:
        return
    what = "a torch Dataset without __len__" if isinstance(value, Dataset) else f"a {type(value).__name__}"
    hint = " (one split of it, e.g. ds['train'])" if isinstance(value, Mapping) else ""
    raise UserError(f"{where} is {what}; ddplab takes {ACCEPTED}{hint}")


def build_model(cfg, ctx, work: Workload, data: Data) -> torch.nn.Module:
    """The workload's model, checked by one forward pass on two training samples."""
    model = _call(work.model, f"model.name={cfg.model.name}", build_config(cfg, "model", ctx), data)
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model.name={cfg.model.name} returned {type(model).__name__}, not a torch.nn.Module")
    # Already torch.compile'd: the plain module is trained, checked without compiling it, and saved with its
    # own keys (no _orig_mod.); training.compile compiles it where ddplab compiles its own (after DDP).
    model = uncompiled(model)
    check_output(model, data)
    for module in model.modules() if cfg.model.dropout_off else ():
        if isinstance(module, DROPOUT):
            module.p = 0.0
    return model


def _said(exc: BaseException) -> str:
    """An exception's type and first line; without text (an AttributeError raised bare), the line that raised it."""
    text = first_line(exc, 160)
    if not text and exc.__traceback__ is not None:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        text = f"no message, raised at {frame.filename}:{frame.lineno}: {frame.line}"
    return f"{type(exc).__name__}: {text}"


def _text_hint(items: list) -> str:
    """A collator that pads token ids fails on a text column left beside them."""
    texts = sorted({k for item in items if isinstance(item, Mapping) for k, v in item.items() if isinstance(v, str)})
    return f" (the items hold text fields {texts}: remove them, e.g. ds.remove_columns({texts}))" if texts else ""


def stochastic_parts(model: torch.nn.Module, data: Data) -> dict:
    """What makes an N-process run differ from one process by more than rounding, as far as it can be
    seen: dropout modules still drawing (each rank its own masks), BatchNorm (statistics of each rank's
    batch), random transforms on the training set (each rank's own draws)."""
    dropout = sum(isinstance(m, DROPOUT) and m.p > 0 for m in model.modules())
    batchnorm = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    transforms, dataset = [], data.train
    while dataset is not None:  # Subset / wrappers keep the dataset that holds the transform
        transform = getattr(dataset, "transform", None)
        for t in getattr(transform, "transforms", [transform] if transform is not None else []):
            if type(t).__name__.startswith("Random"):
                transforms.append(type(t).__name__)
        dataset = getattr(dataset, "dataset", None)
    return {"dropout_modules": int(dropout), "batchnorm_modules": batchnorm, "random_transforms": transforms}


def check_output(model: torch.nn.Module, data: Data) -> None:
    """One forward pass on two training samples: an output the task cannot score, or a loss that
    is not a finite scalar tensor, fails here rather than in every worker's first step."""
    train = data.train
    items = list(islice(train, 2)) if is_stream(train) else [train[i] for i in range(min(2, len(train)))]
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 or isinstance(item, Mapping)):
            raise UserError(
                f"data: a dataset item must be (inputs, target) or a dict holding its target "
                f"('labels' or 'label'), got {type(item).__name__}"
                f"{' of length ' + str(len(item)) if isinstance(item, (tuple, list)) else ''}"
            )
    collate = data.collate_fn or torch.utils.data.default_collate
    try:
        batch = collate(items)
    except Exception as exc:  # noqa: BLE001 - the user's data: say what broke, in one line
        raise UserError(
            f"data: two items do not collate into a batch ({_said(exc)}); give Data(collate_fn=...){_text_hint(items)}"
        ) from None
    inputs, target, _ = data.task.unpack(batch)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = call_model(model, inputs)
    except Exception as exc:  # noqa: BLE001 - a bug in the model's code: exit 1, its traceback in logs/
        given = f"keywords {sorted(map(str, inputs))}" if isinstance(inputs, Mapping) else f"a {type(inputs).__name__}"
        raise RunError(
            f"model: a forward pass on a batch of {len(target)} ({given}) failed ({_said(exc)}) at {place_of(exc)}"
        ) from exc
    finally:
        model.train(was_training)
    task = data.task
    _call(task.check_output, f"{type(task).__name__}.check_output(output, target)", output, target)
    where = f"{type(task).__name__}.loss(output, target)"
    with torch.no_grad():
        loss = _call(task.loss, where, output, target)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UserError(
            f"{where} returned {shape} on a batch of {len(target)}; it must return a scalar tensor (e.g. .mean())"
        )
    if not torch.isfinite(loss):
        raise UserError(f"{where} returned {loss.item()} on the first two training samples; it must be finite")


def unused_parameters(exc: RuntimeError, model: torch.nn.Module) -> RunError | None:
    """DDP's error for parameters that got no gradient (its text runs to a page and names indices), as
    one line naming them and the setting that allows them; None for any other error."""
    text = str(exc)
    if "Expected to have finished reduction in the prior iteration" not in text:
        return None
    indices = re.search(r"did not receive grad for rank \d+: ([\d ]+)", text)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    unused = [names[int(i)] for i in indices.group(1).split() if int(i) < len(names)] if indices else []
    shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
    return RunError(
        f"parameters without a gradient ({shown or 'unnamed'}): set "
        f"distributed.find_unused_parameters=true, or requires_grad=False on them"
    )
