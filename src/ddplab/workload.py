"""The one door every workload comes through, built-in or the user's own: `data(cfg) -> ddplab.Data` and
`model(cfg, data) -> torch.nn.Module`, named by a built-in name or a code reference (`file.py:function`,
`package.module:function`), so the engine never asks which kind it got."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddplab.errors import UserError, first_line
from ddplab.runtime import process_state


@dataclass
class Data:
    """Splits and the task that scores them (docs/your-workload.md#ddplabdata). `meta`: plain values inference
    needs, stored in checkpoints; `assets`: files inference needs, copied into the run folder; `state`: objects
    with state_dict() / load_state_dict() that every snapshot holds, each rank's own."""

    train: Any
    val: Any = None
    test: Any = None
    task: Any = None  # a ddplab.Task
    collate_fn: Callable | None = None
    meta: dict = field(default_factory=dict)
    input_shape: tuple | None = None  # one sample's shape (images), for models that need it
    preprocess: Callable | None = None  # one raw input -> one sample's inputs, for `ddplab predict`
    state: dict = field(default_factory=dict)  # name -> stateful object, saved and restored per rank
    assets: dict = field(default_factory=dict)  # name -> a file or folder, saved into the run folder's inference/

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
class Assets:
    """What a run saved for inference (the run folder's inference/), given to the data function as `cfg.assets`
    by `ddplab predict`: it may return Data(train=None, preprocess=..., collate_fn=...) built from it alone."""

    meta: dict  # Data.meta, as the weights were trained with
    task: Any  # the Data.task, rebuilt from its description
    folder: Path | None = None  # the run's inference/ folder; None for a checkpoint away from its run folder
    files: dict = field(default_factory=dict)  # Data.assets' names -> path inside `folder`

    def path(self, name: str) -> Path:
        """Where the file or folder that training's Data.assets[name] named was saved."""
        if name not in self.files:
            saved = ", ".join(sorted(self.files)) or "none"
            raise UserError(
                f"cfg.assets.path({name!r}): this run saved no such asset (saved: {saved}); "
                f"name it in Data(assets=...) at training, and predict from the run folder"
            )
        return self.folder / self.files[name]


@dataclass
class BuildConfig:
    """What a workload function is given: its section's options, the whole config, and the job."""

    options: Options
    config: Any  # the resolved ddplab Config, frozen (frozen.freeze)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dist: Any = None  # the DistContext (built-ins use it; user code rarely needs it)
    assets: Assets | None = None  # set by `ddplab predict` only: what the run saved for inference

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


def build_config(cfg, section: str, ctx=None, assets: Assets | None = None) -> BuildConfig:
    """What a workload function of `section` ("data", "model") is given, in the job `ctx` (or none)."""
    options = Options(getattr(cfg, section).options or {})
    if ctx is None:
        return BuildConfig(options, cfg, assets=assets)
    return BuildConfig(options, cfg, ctx.rank, ctx.world_size, ctx.launch.local_rank, ctx, assets=assets)


def is_reference(name: str) -> bool:
    return ":" in name


def _import_file(path: Path) -> Any:
    key = "ddplab_user_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None:  # a name Python has no loader for
        raise UserError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    # The file's folder is importable too, as when a user runs `python file.py`.
    process_state.import_path(str(path.parent))
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
        raise UserError(
            f"{field_name}: '{reference}' is not a code reference of the form file.py:function "
            f"or package.module:function"
        )
    if _is_file_reference(where):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"{field_name}: no such file: {where} (from '{reference}')")
        module = _import_file(path)
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:  # noqa: BLE001 - any failure of user code is the user's to see
            if isinstance(exc, ModuleNotFoundError) and exc.name and where.startswith(exc.name):
                raise UserError(f"{field_name}: no module named '{where}' (from '{reference}')") from None
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
    """The file a reference loads code from, found without importing anything."""
    files = code_files(reference)
    return files[-1] if files else None


def _is_file_reference(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def code_files(reference: str) -> list[Path] | None:
    """The files that importing `reference` runs (a module's after its packages' __init__ files), found without
    running any (`importlib.util.find_spec` imports a module's packages); None when there is no such module."""
    where = reference.rpartition(":")[0]
    if _is_file_reference(where):
        return [Path(where).expanduser().resolve()]
    files, search, parts = [], None, where.split(".") if where else []
    for i in range(len(parts)):
        spec = _find_spec(".".join(parts[: i + 1]), search)
        if spec is None or (spec.submodule_search_locations is None and i < len(parts) - 1):
            return None
        if spec.has_location and spec.origin:
            files.append(Path(spec.origin).resolve())
        search = spec.submodule_search_locations
    return files if parts else None


def _find_spec(name: str, path) -> Any:
    if name in sys.modules:  # imported already: nothing new runs
        return getattr(sys.modules[name], "__spec__", None)
    for finder in sys.meta_path:
        try:
            spec = finder.find_spec(name, path)
        except (AttributeError, ImportError, ValueError):  # not a finder of modules, or not a module name
            continue
        if spec is not None:
            return spec
    return None


def reference_of(fn: Callable) -> str:
    """How a run folder names a function handed to ddplab.train(): file.py:name (or module:name)."""
    module = inspect.getmodule(fn)
    qualname = getattr(fn, "__qualname__", getattr(fn, "__name__", "?"))
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise UserError(
            f"{qualname}: pass a function defined at the top level of a file or module "
            f"(predict, generate and resume import it again by name)"
        )
    source = inspect.getsourcefile(fn) if module is not None else None
    if (
        module is not None
        and module.__name__ not in ("__main__",)
        and not module.__name__.startswith("ddplab_user_")
        and module.__spec__ is not None
        and not source
    ):
        return f"{module.__name__}:{qualname}"
    if source is None:
        raise UserError(f"{qualname}: cannot tell which file defines it")
    path = Path(source).resolve()
    return f"{path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}:{qualname}"


TRUST_FILE = "trusted-code.sha256"  # in $XDG_STATE_HOME/ddplab/: `sha256  path` of every file trained with
_PACKAGE = Path(__file__).resolve().parent  # ddplab's own code


def trust_file() -> Path:
    """This machine's record of the workload files its user trained with (outside every run folder)."""
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "ddplab" / TRUST_FILE


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _trained_with() -> set[str]:
    try:
        return {line.split()[0] for line in trust_file().read_text().splitlines() if line.strip()}
    except OSError:
        return set()


def remember_code(references) -> None:
    """Training imports these references: their files' contents become code predict and generate import
    without --trust-code. A record that cannot be written only means asking again."""
    files = [f for r in references if is_reference(r) for f in code_files(r) or [] if not f.is_relative_to(_PACKAGE)]
    known = _trained_with()
    lines = [f"{d}  {f}\n" for f in files if (d := _digest(f)) and d not in known]
    if lines:
        with contextlib.suppress(OSError):
            trust_file().parent.mkdir(parents=True, exist_ok=True)
            with open(trust_file(), "a") as record:
                record.write("".join(lines))


def check_trusted(reference: str, trust_code: bool, field_name: str, run: str | Path = ".") -> None:
    """Code a run folder or checkpoint names is imported only when this machine trained with that very code, when
    it is an installed module (outside the current directory and `run`), or with --trust-code."""
    if not is_reference(reference):
        return  # a built-in name
    files = code_files(reference)
    if files is None:
        raise UserError(f"{field_name}: no module named '{reference.rpartition(':')[0]}' (from '{reference}')")
    module = not _is_file_reference(reference.rpartition(":")[0])
    run = Path(run).resolve()
    places = (Path.cwd().resolve(), run if run.is_dir() else run.parent)
    known = _trained_with()
    unknown = [
        f
        for f in files
        if f.is_file()
        and not f.is_relative_to(_PACKAGE)
        and _digest(f) not in known
        and not (module and not any(f.is_relative_to(p) for p in places))
    ]
    if unknown and not trust_code:
        raise UserError(
            f"{field_name}: this run's code {unknown[0]} is not code this machine trained with; "
            f"read it, then pass --trust-code to import it"
        )
    if files and files[-1].is_file():
        print(f"ddplab: importing {field_name} code from {files[-1]}", file=sys.stderr)
