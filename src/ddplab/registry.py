"""The names users type, and the one loader of a config.

Each built-in name maps to its workload function in ddplab/workloads/ as a `package.module:function` reference,
resolved as a user's `file.py:function` is, so the engine cannot tell them apart; with the task and inputs it
serves (which model fits which data is decided here alone) and torch-free checks run on the config alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ddplab.config import INT_MAX, MAX_PROCESSES, Config, DistributedConfig
from ddplab.config.frozen import freeze
from ddplab.config.reading import read_config
from ddplab.data.checks import check_memory, check_stream, check_stream_files, image_spec
from ddplab.errors import UserError
from ddplab.models.checks import check_image_input
from ddplab.runtime.extras import install_line, missing, require
from ddplab.workload import Workload, is_reference, reference_of, resolve


@dataclass(frozen=True)
class Builtin:
    ref: str  # the workload function, "package.module:function"
    task: str  # "lm" | "classification" | "any" (made to fit the model)
    inputs: str  # "tokens" | "text" | "image" | "any"
    image: tuple | None = None  # (channels, default side) a vision model wants; None: the data's own
    check: str | None = None  # (cfg) -> None, from the config alone, without torch
    check_files: str | None = None  # (cfg) -> None, the files the config names
    extra: str | None = None  # the optional part of ddplab it needs (ddplab.runtime.extras)

    def call(self, what: str, cfg) -> None:
        reference = getattr(self, what)
        if reference:
            resolve(reference, what)(cfg)


_W = "ddplab.workloads."
MODELS: dict[str, Builtin] = {
    "gpt": Builtin(_W + "char_lm:gpt", "lm", "tokens"),
    "transformer": Builtin(_W + "text_classification:transformer", "classification", "text", extra="text"),
    "hf": Builtin(
        _W + "text_classification:hf", "classification", "text", check="ddplab.models.checks:check_hf", extra="text"
    ),
    "cnn": Builtin(_W + "images:model", "classification", "image", image=(None, None), extra="vision"),
    "vit": Builtin(_W + "images:model", "classification", "image", image=(None, None), extra="vision"),
}
# Every torchvision classifier by name: RGB at the side its ImageNet weights were made for.
TORCHVISION = Builtin(
    _W + "images:model",
    "classification",
    "image",
    image=(3, 224),
    check="ddplab.models.vision:check_input",
    check_files="ddplab.models.vision:check_files",
    extra="vision",
)

_IMAGES: dict[str, Any] = dict(
    task="classification",
    inputs="image",
    check="ddplab.data.checks:check_images",
    check_files="ddplab.data.checks:check_image_files",
    extra="vision",
)
_TEXTS: dict[str, Any] = dict(
    task="classification", inputs="text", check="ddplab.data.checks:check_text_classes", extra="text"
)
DATA: dict[str, Builtin] = {
    "text": Builtin(_W + "char_lm:data", "lm", "tokens", check="ddplab.data.checks:check_corpus"),
    "synthetic": Builtin(_W + "synthetic:data", "any", "any"),
    **{
        name: Builtin(_W + "images:data", **_IMAGES)
        for name in ("digits", "mnist", "fashion_mnist", "cifar10", "image_folder")
    },
    **{
        name: Builtin(_W + "text_classification:data", **_TEXTS)
        for name in ("imdb", "amazon_polarity", "text_files", "synthetic_reviews")
    },
}


def model_entry(name: str) -> Builtin | None:
    """The table's entry for a model name; None for a code reference. Unknown names list the valid ones."""
    if is_reference(name):
        return None
    if name in MODELS:
        return MODELS[name]
    if missing("vision", ("torchvision",)):
        raise UserError(
            f"model.name: unknown model '{name}'; choose one of {', '.join(MODELS)}, a torchvision "
            f"classifier ({install_line('vision')}), or your own file.py:function"
        )
    from ddplab.models import vision  # imports torchvision: only for a name that is none of ddplab's own

    if vision.is_torchvision(name):
        return TORCHVISION
    raise UserError(vision.unknown_model(name, list(MODELS)))


def data_entry(name: str) -> Builtin | None:
    if is_reference(name):
        return None
    if name not in DATA:
        raise UserError(
            f"data.name: unknown dataset '{name}'; choose one of {', '.join(sorted(DATA))}, "
            f"or your own file.py:function"
        )
    return DATA[name]


def image_needs(model_name: str) -> tuple[int | None, int | None]:
    """(channels, default side) the model wants of images; (None, None): whatever the data has."""
    entry = model_entry(model_name)
    return entry.image if entry is not None and entry.image else (None, None)


def builtin_names() -> tuple[list[str], list[str]]:
    """(model names, data names) for --help; torchvision classifiers are one entry."""
    return [*MODELS, "<torchvision classifier>"], list(DATA)


# ---------------------------------------------------------------------------- checks


def check_config(cfg: Config, given: tuple = ()) -> None:
    """Names, references and which model fits which data, before any process starts; `given`: sections
    whose function ddplab.train() was handed, which is not imported again by its reference."""
    model, data = model_entry(cfg.model.name), data_entry(cfg.data.name)
    for entry, section in ((model, "model"), (data, "data")):
        if entry is None and section not in given:
            resolve(getattr(cfg, section).name, f"{section}.name")
    if model is not None and data is not None:
        if data.inputs not in ("any", model.inputs) or data.task not in ("any", model.task):
            raise UserError(_mismatch(cfg, model, data))
    check_stream(cfg)
    for entry, section in ((model, "model"), (data, "data")):
        if entry is not None:
            if entry.extra:
                require(entry.extra, f"{section}.name={getattr(cfg, section).name}")
            entry.call("check", cfg)
    check_decode(cfg)
    if cfg.distributed.sync_batchnorm:
        _need_cuda(
            "distributed.sync_batchnorm=true needs CUDA (torch's SyncBatchNorm runs on GPUs only) and "
            "this machine has none; leave it false on CPU"
        )
    t = cfg.training
    if t.optimizer not in ("adamw", "sgd") or t.optimizer_options or t.schedule not in ("cosine", "linear", "constant"):
        from ddplab.engine.loop.optim import check_names  # imports torch: only for a name that is none of ddplab's own

        check_names(t)
    d = cfg.distributed
    if d.strategy != "ddp" and d.comm_hook != "none":
        raise UserError(
            f"distributed.comm_hook={d.comm_hook} is a DDP communication hook; distributed.strategy="
            f"{d.strategy} reduces gradients itself: set distributed.comm_hook=none or strategy=ddp"
        )
    if d.shard:
        resolve(d.shard, "distributed.shard")
    if d.fault_tolerance == "replicas":
        require("ft", "distributed.fault_tolerance=replicas")
    for tracker in cfg.logging.trackers:  # mlflow, wandb: each the module of its own name
        if tracker != "tensorboard":
            require("track", f"logging.trackers={tracker}", (tracker,))
    if model is not None and data is not None and model.inputs == data.inputs == "image":
        _, channels, side = image_spec(cfg, *image_needs(cfg.model.name))
        check_image_input(cfg, channels, side)
    check_memory(cfg)


def check_decode(cfg: Config) -> None:
    """data.decode=gpu: JPEGs of an image_folder tree (files or a jpeg cache), on a machine with CUDA."""
    if cfg.data.decode != "gpu":
        return
    if cfg.data.name != "image_folder":
        raise UserError(f"data.decode=gpu decodes the JPEG files of data.name=image_folder; {cfg.data.name} has none")
    if cfg.data.cache == "raw":
        raise UserError("data.decode=gpu needs data.cache=jpeg or data.cache=false: a raw cache holds decoded pixels")
    _need_cuda("data.decode=gpu needs CUDA (nvJPEG on each rank's GPU) and this machine has none; use data.decode=cpu")


def _need_cuda(message: str) -> None:
    import torch  # only for a setting that runs on GPUs: whether this machine has one

    if not torch.cuda.is_available():
        raise UserError(message)


def checked_without_torch(cfg: Config) -> bool:
    """Both functions come with torch-free checks (check_config ran them); a workload without them
    is built once in the launcher instead (commands.train.preflight), before any worker starts."""
    return model_entry(cfg.model.name) is not None and data_entry(cfg.data.name) is not None


def _mismatch(cfg, model: Builtin, data: Builtin) -> str:
    fitting = sorted(n for n, s in DATA.items() if s.inputs in ("any", model.inputs) and s.task in ("any", model.task))
    models = [n for n, s in MODELS.items() if s.inputs == data.inputs and s.task == data.task]
    if data.inputs == "image":
        models.append("any torchvision classifier")
    return (
        f"model.name={cfg.model.name} reads {model.inputs} for a {model.task} task but data.name={cfg.data.name} "
        f"gives {data.inputs} ({data.task}): use model.name={' or '.join(models)}, or data.name one of "
        f"{', '.join(fitting)}"
    )


def check_files(cfg: Config) -> None:
    """The files the config names (dataset folders, weights) exist and fit; run before launch."""
    model, data = model_entry(cfg.model.name), data_entry(cfg.data.name)
    if model is not None:
        model.call("check_files", cfg)
    if cfg.data.stream:  # shards, not the files a source reads whole
        check_stream_files(cfg)
    elif data is not None:
        data.call("check_files", cfg)


# ---------------------------------------------------------------------------- loading


def load_config(
    source: str | Path | dict | Config | None = None,
    overrides=(),
    *,
    model: Callable | None = None,
    data: Callable | None = None,
    lighthouse_started: bool = False,
) -> Config:
    """The one config loader every command uses: YAML path (None: the embedded default), dict or Config (read as a
    copy), then `key=value` overrides; checked, and frozen. Functions handed to ddplab.train() take the place of
    model.name / data.name. `lighthouse_started`: the caller starts the Lighthouse itself (`--replica-groups`)."""
    handed = [(section, fn) for section, fn in (("model", model), ("data", data)) if fn is not None]
    cfg = read_config(source, [*overrides, *(f"{section}.name={reference_of(fn)}" for section, fn in handed)])
    cfg = replace(cfg, distributed=replica_place(cfg.distributed, os.environ))
    check_config(cfg, tuple(section for section, _ in handed))
    if cfg.distributed.fault_tolerance == "replicas":  # torchft is there (check_config): where its Lighthouse is
        address = _lighthouse(cfg.distributed.lighthouse, os.environ, lighthouse_started)
        cfg = replace(cfg, distributed=replace(cfg.distributed, lighthouse=address))
    return freeze(absolute_references(cfg))


def replica_place(d: DistributedConfig, env: Mapping[str, str]) -> DistributedConfig:
    """distributed.replica_group and replica_groups where the config leaves them unset: under fault_tolerance=replicas
    from torchft's REPLICA_GROUP_ID and NUM_REPLICA_GROUPS, else a SLURM job array's task, else 0 of 1. Resolved here,
    once, so that every reader and the run folder's config.yaml see the numbers the job ran with."""
    env = env if d.fault_tolerance == "replicas" else {}  # any other job: whatever its environment says
    # (where the number came from, as a user would write it; the number)
    group = (
        _given("distributed.replica_group", d.replica_group)
        or _from_env(env, "REPLICA_GROUP_ID")
        or _array_task(env)
        or ("distributed.replica_group=0 (its default)", 0)
    )
    groups = (
        _given("distributed.replica_groups", d.replica_groups)
        or _from_env(env, "NUM_REPLICA_GROUPS")
        or _from_env(env, "SLURM_ARRAY_TASK_COUNT")
        or ("distributed.replica_groups=1 (its default)", 1)
    )
    if not 1 <= groups[1] <= MAX_PROCESSES:
        raise UserError(f"{groups[0]}: a job has 1 to {MAX_PROCESSES} replica groups (no machines hold more)")
    if group[1] >= groups[1]:
        hint = "; a SLURM job array of N groups is --array=0-<N-1>" if group[0].startswith("SLURM") else ""
        raise UserError(f"{group[0]} is not below {groups[0]}{hint}")
    return replace(d, replica_group=group[1], replica_groups=groups[1])


def _lighthouse(given: str | None, env: Mapping[str, str], started: bool) -> str | None:
    """The Lighthouse's address, checked for its form: torchft's client takes any text and waits the whole
    distributed.timeout on one it cannot use, then fails after the run folder exists. A launcher that starts
    one (`started`) hands its address to the groups, which check it."""
    if started:
        return given
    address = given if given is not None else env.get("TORCHFT_LIGHTHOUSE")
    if not address:
        raise UserError(
            "distributed.fault_tolerance=replicas needs a torchft Lighthouse: set distributed.lighthouse="
            "http://HOST:PORT (or $TORCHFT_LIGHTHOUSE) to one that runs, or start one with the job: "
            "ddplab train --replica-groups N"
        )
    if not _lighthouse_address(address):
        named = "distributed.lighthouse" if given is not None else "TORCHFT_LIGHTHOUSE"
        where = "" if given is not None else " in the environment"
        raise UserError(f"{named}={address!r}{where} is not a Lighthouse address: give http://HOST:PORT (or https://)")
    return address


def _lighthouse_address(text: str) -> bool:
    """`text` is an address torchft's client can reach: http(s)://HOST:PORT, nothing after the port."""
    try:
        url = urlsplit(text)
        port = url.port  # a port that is no number from 0 to 65535 raises, as does a bracket left open
    except ValueError:
        return False
    return (
        url.scheme in ("http", "https")
        and bool(url.hostname and port)
        and url.path in ("", "/")
        and not (url.query or url.fragment or any(c.isspace() for c in text))
    )


def _given(dotted: str, value: int | None) -> tuple[str, int] | None:
    return None if value is None else (f"{dotted}={value}", value)


def _from_env(env: Mapping[str, str], name: str) -> tuple[str, int] | None:
    """(how it reads, the number) of a whole number in the environment; None when unset or empty."""
    text = env.get(name, "").strip()
    if not text:
        return None
    if not (text.isascii() and text.isdecimal()) or int(text) > INT_MAX:
        raise UserError(f"{name}={text!r} in the environment is not a whole number from 0 to 2^63 - 1")
    return f"{name}={text}", int(text)


def _array_task(env: Mapping[str, str]) -> tuple[str, int] | None:
    """This task's place in its SLURM job array, counted from the array's first task."""
    task = _from_env(env, "SLURM_ARRAY_TASK_ID")
    if task is None:
        return None
    first = _from_env(env, "SLURM_ARRAY_TASK_MIN") or ("SLURM_ARRAY_TASK_MIN=0", 0)
    if task[1] < first[1]:
        raise UserError(f"{task[0]} is below {first[0]}")
    return (f"{task[0]} - {first[0]}" if first[1] else task[0]), task[1] - first[1]


def absolute_references(cfg: Config) -> Config:
    """`cfg` with its file.py:function references made absolute, so every rank, a resume, predict and generate
    import the very file this run used, whatever their working directory."""

    def absolute(name: str) -> str:
        where, _, function = name.rpartition(":")
        return f"{Path(where).expanduser().resolve()}:{function}" if where.endswith(".py") or "/" in where else name

    m, d, t = cfg.model, cfg.data, cfg.training
    return replace(
        cfg,
        model=replace(m, name=absolute(m.name)),
        data=replace(d, name=absolute(d.name)),
        training=replace(t, optimizer=absolute(t.optimizer), schedule=absolute(t.schedule)),
    )


# ---------------------------------------------------------------------------- building


def workload(cfg: Config, data_fn: Callable | None = None, model_fn: Callable | None = None) -> Workload:
    """The config's workload (a built-in name's function reference; a code reference as given); functions handed to
    ddplab.train() are used as given."""
    data, model = data_entry(cfg.data.name), model_entry(cfg.model.name)
    refs = {"data": data.ref if data else cfg.data.name, "model": model.ref if model else cfg.model.name}
    return Workload(
        data_fn or resolve(refs["data"], "data.name"), model_fn or resolve(refs["model"], "model.name"), refs
    )
