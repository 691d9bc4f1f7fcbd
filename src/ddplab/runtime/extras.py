"""Optional parts of ddplab and the libraries each one needs (pyproject.toml's extras). The core install
trains any workload of plain tensors; what needs more names its extra in one line before any process starts."""

from __future__ import annotations

import importlib.util
import shlex
from importlib import metadata

from packaging.requirements import Requirement

from ddplab.errors import UserError

EXTRAS = {
    "text": ("transformers", "datasets", "pandas", "pyarrow", "fsspec"),
    "vision": ("torchvision", "PIL", "sklearn"),
    "report": ("matplotlib", "scipy"),
    "track": ("mlflow", "wandb"),
    "ft": ("torchft",),
    "ray": ("ray",),
}


def missing(extra: str, modules: tuple[str, ...] | None = None) -> list[str]:
    """The extra's modules (or the given subset) that cannot be imported here."""
    return [m for m in (modules or EXTRAS[extra]) if importlib.util.find_spec(m) is None]


def require(extra: str, what: str, modules: tuple[str, ...] | None = None) -> None:
    """One line naming the extra when `what` (a command, a config value) cannot run without it."""
    if gone := missing(extra, modules):
        raise UserError(f"{what} needs {', '.join(gone)}: {install_line(extra)}")


def install_line(extra: str) -> str:
    """How to install an extra without asking a registry for ddplab (none hosts it): the extra's packages as the
    installed ddplab's own metadata declares them, so the line works for a wheel and a clone alike."""
    try:
        declared = metadata.requires("ddplab") or []
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, never installed: only its clone has it
        return f"pip install '.[{extra}]' in ddplab's clone"
    wanted = [
        r.split(";")[0].strip() for r in declared if (m := Requirement(r).marker) and m.evaluate({"extra": extra})
    ]
    return f"pip install {' '.join(map(shlex.quote, wanted))} (ddplab's {extra} extra)"
