"""The one door every workload comes through, built-in or the user's own.

A workload is two functions:

    data(cfg) -> ddplab.Data                      # cfg.options: data.options.*
    model(cfg, data) -> torch.nn.Module           # cfg.options: model.options.*

`model.name` / `data.name` are a built-in name (ddplab.registry maps each to a function in
ddplab/workloads/) or a code reference: `path/to/file.py:function` or
`package.module:function`. Both go through the one resolver here, so the engine never asks
which kind it got.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ddplab.errors import UserError, first_line


@dataclass
class Data:
    """Splits and the task that scores them. A split is a torch Dataset with __len__, a torch
    IterableDataset (a stream), or a Hugging Face Dataset / IterableDataset; its items are
    `(inputs, target)` or a dict holding its target (`labels`, else `label`): docs/your-workload.md.

    `inputs` is a tensor, or a dict of tensors passed to the model as keywords. `meta` holds
    plain values that inference needs (tokenizer, label names); it is stored in checkpoints.
    """

    train: Any
    val: Any = None
    test: Any = None
    task: Any = None  # a ddplab.Task
    collate_fn: Callable | None = None
    meta: dict = field(default_factory=dict)
    input_shape: tuple | None = None  # one sample's shape (images), for models that need it
    # One raw input (a file path, a text, numbers) -> one sample's inputs, for `ddplab predict`.
    preprocess: Callable | None = None

    # What built-in model builders read.
    @property
    def num_classes(self) -> int | None:
        return getattr(self.task, "num_classes", None)

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.task, "vocab_size", None) or self.meta.get("vocab_size")


class Options(dict):
    """data.options / model.options: a dict whose keys also read as attributes."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no option '{name}' (given: {', '.join(self) or 'none'})") from None


@dataclass
class BuildConfig:
    """What a workload function is given: its section's options, the whole config, and the job."""

    options: Options
    config: Any  # the resolved ddplab Config (read it, do not change it)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dist: Any = None  # the DistContext (built-ins use it; user code rarely needs it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def seed(self) -> int:
        return self.config.experiment.seed

    def barrier(self) -> None:
        """All ranks wait here (e.g. rank 0 prepares files first, then the others read them)."""
        if self.dist is not None:
            self.dist.barrier()


@dataclass
class Workload:
    """The two functions a run calls, and where they came from (recorded in the run folder)."""

    data: Callable  # (BuildConfig) -> Data
    model: Callable  # (BuildConfig, Data) -> nn.Module
    references: dict


def build_config(cfg, section: str, ctx=None) -> BuildConfig:
    """What a workload function of `section` ("data", "model") is given, in the job `ctx` (or none)."""
    options = Options(getattr(cfg, section).options or {})
    job = () if ctx is None else (ctx.rank, ctx.world_size, ctx.launch.local_rank, ctx)
    return BuildConfig(options, cfg, *job)


# ---------------------------------------------------------------------------- code references

def is_reference(name: str) -> bool:
    return ":" in name


def _import_file(path: Path) -> Any:
    key = "ddplab_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    # The file's folder is importable too, as when a user runs `python file.py`.
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of user code is the user's to see
        del sys.modules[key]
        raise UserError(f"importing {path} raised {type(exc).__name__}: {first_line(exc)}") from None
    return module


def resolve(reference: str, field_name: str) -> Callable:
    """`file.py:function` or `package.module:function` -> the callable (one line if it cannot be had)."""
    where, _, name = reference.rpartition(":")
    if not where or not name:
        raise UserError(f"{field_name}: '{reference}' is not a code reference of the form file.py:function "
                        f"or package.module:function")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"{field_name}: no such file: {where} (from '{reference}')")
        module = _import_file(path)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if exc.name and where.startswith(exc.name):
                raise UserError(f"{field_name}: no module named '{where}' (from '{reference}')") from None
            raise UserError(f"{field_name}: importing {where} raised ModuleNotFoundError: {first_line(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - any failure of user code is the user's to see
            raise UserError(f"{field_name}: importing {where} raised {type(exc).__name__}: {first_line(exc)}") from None
    target = module
    for part in name.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise UserError(f"{field_name}: {where} has no function '{name}'")
    if not callable(target):
        raise UserError(f"{field_name}: {where}:{name} is a {type(target).__name__}, not a function")
    return target


def reference_file(reference: str) -> Path | None:
    """The file a reference loads code from (a module's file for package.module:function)."""
    where = reference.rpartition(":")[0]
    if where.endswith(".py") or "/" in where:
        return Path(where).expanduser().resolve()
    try:
        spec = importlib.util.find_spec(where) if where else None
    except ImportError:
        return None
    return Path(spec.origin).resolve() if spec is not None and spec.origin else None


def reference_of(fn: Callable) -> str:
    """How a run folder names a function handed to ddplab.train(): file.py:name (or module:name)."""

    module = inspect.getmodule(fn)
    qualname = getattr(fn, "__qualname__", getattr(fn, "__name__", "?"))
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise UserError(f"{qualname}: pass a function defined at the top level of a file or module "
                        f"(predict, generate and resume import it again by name)")
    source = inspect.getsourcefile(fn) if module is not None else None
    if module is not None and module.__name__ not in ("__main__",) and not module.__name__.startswith("ddplab_user_") \
            and module.__spec__ is not None and not source:
        return f"{module.__name__}:{qualname}"
    if source is None:
        raise UserError(f"{qualname}: cannot tell which file defines it")
    path = Path(source).resolve()
    return f"{path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}:{qualname}"


def check_trusted(reference: str, trust_code: bool, field_name: str) -> Path | None:
    """Code a run folder names runs only from inside the current directory tree, or when trusted."""
    path = reference_file(reference) if is_reference(reference) else None
    if path is None:
        return None
    inside = path.is_relative_to(Path.cwd().resolve())
    # An installed package (site-packages) is code the user already chose to run.
    installed = any(part in ("site-packages", "dist-packages") for part in path.parts)
    if not inside and not trust_code and not installed:
        raise UserError(f"{field_name}: this run's code is {path}, outside the current directory; "
                        f"pass --trust-code to import it")
    print(f"ddplab: importing {field_name} code from {path}", file=sys.stderr)
    return path
