"""Every built-in workload, declared once, and the door user code comes through too.

One record per model and per data source: where its builder lives ("module:function",
imported only when used, so listing names or checking a config needs no torch), which task
it serves, which inputs it reads or makes, and its cheap checks. Which model fits which data
is decided here and nowhere else: a model and a data source fit when their inputs match.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ddplab.errors import UserError
from ddplab.workload import BuildConfig, Data, Options, is_reference, resolve


@dataclass(frozen=True)
class Spec:
    build: str  # "module:function"; data: (cfg, ctx) -> DataBundle, model: (cfg, data) -> nn.Module
    task: str  # "lm" | "classification" | "any" (made to fit the model)
    inputs: str  # "tokens" | "text" | "image" | "any"
    image: tuple | None = None  # (channels, default side) a vision model wants; None: the data's own
    check: str | None = None  # (cfg) -> None, from the config alone
    check_files: str | None = None  # (cfg) -> None, the files the config names

    def load(self, what: str = "build") -> Callable:
        module, name = getattr(self, what).split(":")
        return getattr(importlib.import_module(module), name)


MODELS: dict[str, Spec] = {
    "gpt": Spec("ddplab.models.gpt:build", "lm", "tokens"),
    "transformer": Spec("ddplab.models.transformer:build", "classification", "text"),
    "hf": Spec("ddplab.models.hf:build", "classification", "text", check="ddplab.models.checks:check_hf"),
    "cnn": Spec("ddplab.workloads.images:cnn", "classification", "image", image=(None, None)),
    "vit": Spec("ddplab.workloads.images:vit", "classification", "image", image=(None, None)),
}
# Every torchvision classifier by name: RGB at the side its ImageNet weights were made for.
TORCHVISION = Spec("ddplab.workloads.images:torchvision_model", "classification", "image", image=(3, 224),
                   check="ddplab.models.vision:check_input", check_files="ddplab.models.vision:check_files")

_IMAGES = dict(task="classification", inputs="image", check="ddplab.data.checks:check_images",
               check_files="ddplab.data.checks:check_image_files")
_TEXTS = dict(task="classification", inputs="text", check="ddplab.data.checks:check_text_classes")
DATA: dict[str, Spec] = {
    "text": Spec("ddplab.data.text_lm:build", "lm", "tokens", check="ddplab.data.checks:check_corpus"),
    "synthetic": Spec("ddplab.data.synthetic:build", "any", "any"),
    "digits": Spec("ddplab.workloads.images:data", **_IMAGES),
    "mnist": Spec("ddplab.workloads.images:data", **_IMAGES),
    "fashion_mnist": Spec("ddplab.workloads.images:data", **_IMAGES),
    "cifar10": Spec("ddplab.workloads.images:data", **_IMAGES),
    "image_folder": Spec("ddplab.workloads.images:data", **_IMAGES),
    "imdb": Spec("ddplab.data.text_cls:build", **_TEXTS),
    "amazon_polarity": Spec("ddplab.data.text_cls:build", **_TEXTS),
    "text_files": Spec("ddplab.data.text_cls:build", **_TEXTS),
    "synthetic_reviews": Spec("ddplab.data.text_cls:build", **_TEXTS),
}


def model_spec(name: str) -> Spec | None:
    """The built-in record for a model name; None for a code reference. Unknown names list the valid ones."""
    if is_reference(name):
        return None
    if name in MODELS:
        return MODELS[name]
    from ddplab.models import vision

    if vision.is_torchvision(name):
        return TORCHVISION
    raise UserError(vision.unknown_model(name, list(MODELS)))


def data_spec(name: str) -> Spec | None:
    if is_reference(name):
        return None
    if name not in DATA:
        raise UserError(f"data.name: unknown dataset '{name}'; choose one of {', '.join(sorted(DATA))}, "
                        f"or your own file.py:function")
    return DATA[name]


def image_needs(model_name: str) -> tuple[int | None, int | None]:
    """(channels, default side) the model wants of images; (None, None): whatever the data has."""
    spec = model_spec(model_name)
    return (spec.image if spec is not None and spec.image else (None, None))


def builtin_names() -> tuple[list[str], list[str]]:
    """(model names, data names) for --help; torchvision classifiers are one entry."""
    return [*MODELS, "<torchvision classifier>"], list(DATA)


# ---------------------------------------------------------------------------- checks

def check_config(cfg) -> None:
    """Names, references and which model fits which data, before any process starts."""
    model, data = model_spec(cfg.model.name), data_spec(cfg.data.name)
    if model is None:
        resolve(cfg.model.name, "model.name")
    if data is None:
        resolve(cfg.data.name, "data.name")
    if model is not None and data is not None:
        fits = data.inputs in ("any", model.inputs) and data.task in ("any", model.task)
        if not fits:
            raise UserError(_mismatch(cfg, model, data))
    for spec in (model, data):
        if spec is not None and spec.check:
            spec.load("check")(cfg)
    if model is not None and model.inputs == "image" and data is not None and data.inputs == "image":
        from ddplab.data.checks import image_spec
        from ddplab.models.checks import check_image_input

        _, channels, side = image_spec(cfg, *image_needs(cfg.model.name))
        check_image_input(cfg, channels, side)


def _mismatch(cfg, model: Spec, data: Spec) -> str:
    fitting = sorted(n for n, s in DATA.items() if s.inputs in ("any", model.inputs) and s.task in ("any", model.task))
    models = [n for n, s in MODELS.items() if s.inputs == data.inputs and s.task == data.task]
    if data.inputs == "image":
        models.append("any torchvision classifier")
    return (f"model.name={cfg.model.name} reads {model.inputs} for a {model.task} task but data.name={cfg.data.name} "
            f"gives {data.inputs} ({data.task}): use model.name={' or '.join(models)}, or data.name one of "
            f"{', '.join(fitting)}")


def check_files(cfg) -> None:
    """The files the config names (dataset folders, weights) exist and fit; run before launch."""
    for spec in (model_spec(cfg.model.name), data_spec(cfg.data.name)):
        if spec is not None and spec.check_files:
            spec.load("check_files")(cfg)


# ---------------------------------------------------------------------------- building

@dataclass
class Workload:
    """The two functions a run calls; `references` say where user code came from (for the run folder)."""

    data: Callable  # (BuildConfig) -> Data
    model: Callable  # (BuildConfig, Data) -> nn.Module
    references: dict


def workload(cfg, data_fn: Callable | None = None, model_fn: Callable | None = None) -> Workload:
    """The config's workload; functions handed to ddplab.train() take the place of the names."""
    refs = {}
    if data_fn is None:
        spec = data_spec(cfg.data.name)
        if spec is None:
            data_fn = resolve(cfg.data.name, "data.name")
        else:
            data_fn = _builtin_data(spec)
    if data_spec(cfg.data.name) is None:
        refs["data"] = cfg.data.name
    if model_fn is None:
        model_fn = model_builder(cfg.model.name)
    if model_spec(cfg.model.name) is None:
        refs["model"] = cfg.model.name
    return Workload(data_fn, model_fn, refs)


def model_builder(name: str) -> Callable:
    """(BuildConfig, Data) -> nn.Module for a built-in name or a code reference."""
    spec = model_spec(name)
    return resolve(name, "model.name") if spec is None else _builtin_model(spec)


def _builtin_data(spec: Spec) -> Callable:
    if spec.build.startswith("ddplab.workloads."):  # already a workload function
        return spec.load()

    def data(b: BuildConfig) -> Data:
        return as_data(spec.load()(b.config, b.dist))
    return data


def _builtin_model(spec: Spec) -> Callable:
    if spec.build.startswith("ddplab.workloads."):
        return spec.load()

    def model(b: BuildConfig, data: Data):
        return spec.load()(b.config, data)
    return model


def as_data(bundle) -> Data:
    """A built-in source's bundle, as the Data every workload returns."""
    from ddplab.tasks import Classification, LanguageModeling

    if bundle.task == "lm":
        task = LanguageModeling(bundle.vocab_size)
    else:
        task = Classification(bundle.num_classes, bundle.meta.get("label_names"))
    meta = dict(bundle.meta)
    if bundle.vocab_size is not None:
        meta.setdefault("vocab_size", bundle.vocab_size)
    return Data(train=bundle.train, val=bundle.val, test=bundle.test, task=task, collate_fn=bundle.collate_fn,
                meta=meta, input_shape=bundle.input_shape)


def build_config(cfg, section: str, ctx=None) -> BuildConfig:
    options = Options(getattr(cfg, section).options or {})
    if ctx is None:
        return BuildConfig(options, cfg)
    return BuildConfig(options, cfg, ctx.rank, ctx.world_size, ctx.launch.local_rank, ctx)


def load_config(path=None, overrides=()):
    """The config (types and ranges: ddplab.config) whose names and pairings the registry accepts."""
    from ddplab.config import load_config as load_typed

    cfg = load_typed(path, overrides)
    check_config(cfg)
    absolute_references(cfg)
    return cfg


def absolute_references(cfg) -> None:
    """file.py:function references become absolute, so every rank, a resume, predict and generate
    import the very file this run used, whatever their working directory."""
    for section in (cfg.model, cfg.data):
        where, _, name = section.name.rpartition(":")
        if where.endswith(".py") or "/" in where:
            section.name = f"{Path(where).expanduser().resolve()}:{name}"
