"""`ddplab env`: what a bug report needs, in one paste: versions, devices, extras, and the launcher as read."""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import ddplab
from ddplab.engine.parallel.world import detect_launch, detect_nodes, shown
from ddplab.errors import UserError
from ddplab.runtime.extras import EXTRAS, missing


def env(ns) -> int:
    import torch  # the versions are torch's: imported here only

    print(f"ddplab {ddplab.__version__} ({os.path.dirname(ddplab.__file__)})")
    print(f"python {platform.python_version()} ({sys.executable}); {platform.platform()}")
    gloo = "available" if torch.distributed.is_gloo_available() else "not built in"
    print(f"torch {torch.__version__}; CUDA {torch.version.cuda or 'none'}; {_nccl(torch)}; gloo {gloo}")
    print(f"devices: {_devices(torch)}")
    print("extras: " + "; ".join(_extra(name) for name in EXTRAS))
    print(f"launcher: {_launcher()}")
    variables = shown()
    print("launcher variables:" + ("" if variables else " none set"))
    for name, value in variables.items():
        print(f"  {name}={value!r}" if "\n" in value else f"  {name}={value}")
    return 0


def _nccl(torch) -> str:
    if not torch.distributed.is_nccl_available():
        return "NCCL not built in"
    try:
        return "NCCL " + ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as err:  # noqa: BLE001 - a build whose NCCL library cannot be loaded: say so
        return f"NCCL built in, its library not loaded ({type(err).__name__})"


def _devices(torch) -> str:
    cpus = f"{len(os.sched_getaffinity(0))} CPU cores usable, torch threads {torch.get_num_threads()}"
    if not torch.cuda.is_available():
        return f"no CUDA device; {cpus}"
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    names = ", ".join(
        f"{i}: {p.name} ({p.total_memory / 2**30:.0f} GiB, sm {p.major}.{p.minor})" for i, p in enumerate(gpus)
    )
    return f"{len(gpus)} CUDA device(s): {names}; {cpus}"


def _extra(name: str) -> str:
    gone = missing(name)
    if gone:
        return f"{name} missing {', '.join(gone)}"
    versions = []
    for module in EXTRAS[name]:
        package = {"PIL": "pillow", "sklearn": "scikit-learn"}.get(module, module)
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(module)
    return f"{name} ({', '.join(versions)})"


def _launcher() -> str:
    """How `ddplab train` would read this environment, or the line it would stop with."""
    try:
        nodes = None if "RANK" in os.environ else detect_nodes()
        return f"ddplab train starts {nodes.describe()}" if nodes else detect_launch().describe()
    except UserError as err:
        return f"ddplab train would stop here: {err}"
