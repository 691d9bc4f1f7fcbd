"""The package's shape: layers run one way, no import cycles, imports inside functions only with a
reason.

Layers, lowest first; a module may import its own layer and the layers below, never above:
  contracts  what a workload, a task and a callback are written against, and the config
  parts      the seam to torch.distributed, datasets, tokenizers, caches, models
  engine     the training loop, its checkpoints and run folder
  beside     the names users type (registry), built-in workloads, metric writers (through the
             contracts; they may use the engine)
  commands   what a user runs: train, study, verify, predict, generate, report, forecast
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "ddplab"

LAYERS = [
    (
        "contracts",
        [
            "ddplab.errors",
            "ddplab.config",
            "ddplab.runtime",
            "ddplab.workload",
            "ddplab.tasks",
            "ddplab.evaluators",
            "ddplab.callbacks",
        ],
    ),
    ("parts", ["ddplab.engine.parallel.world", "ddplab.engine.parallel.distributed", "ddplab.data", "ddplab.models"]),
    ("engine", ["ddplab.engine"]),
    ("beside", ["ddplab.registry", "ddplab.workloads", "ddplab.metrics", "ddplab.trackers"]),
    (
        "commands",
        [
            "ddplab.api",
            "ddplab.cli",
            "ddplab.commands",
            "ddplab.study",
            "ddplab.report",
            "ddplab.forecast",
            "ddplab.__main__",
        ],
    ),
]
# The top of the package: what users import (the names ddplab/__init__.py lists come from these, and the registry
# they add names to) and the entry points (`ddplab`, `python -m ddplab`). Everything else lives in a folder.
TOP = {"__init__", "__main__", "api", "callbacks", "cli", "errors", "evaluators", "registry", "tasks", "workload"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, module: str) -> list[tuple[str, int, bool]]:
    """(imported ddplab module, line, inside a function) for every import of the file."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolve against this package
                    package = module.split(".")[: len(module.split(".")) - child.level + (path.name == "__init__.py")]
                    base = ".".join(package + ([base] if base else []))
                found.append((base, child.lineno, in_function))
                found.extend((f"{base}.{a.name}", child.lineno, in_function) for a in child.names)
            visit(child, nested)

    visit(tree, False)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        for target, _, _ in imports(path, module):
            if target in known and target != module:
                edges[module].add(target)
    return edges


def test_the_top_of_the_package_holds_only_what_users_import_and_the_entry_points():
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose == TOP, sorted(loose ^ TOP)


def test_every_module_has_a_layer():
    assert [m for m in modules() if m != "ddplab" and layer(m) is None] == []


def test_no_import_runs_up_a_layer():
    upward = [
        f"{m} ({LAYERS[layer(m)][0]}) imports {t} ({LAYERS[layer(t)][0]})"
        for m, targets in graph().items()
        if m != "ddplab"
        for t in targets
        if layer(t) is not None and layer(m) is not None and layer(t) > layer(m)
    ]
    assert upward == []


# engine/'s rooms, lowest first: each imports only the rooms below it (parallel/world.py and distributed.py, a
# layer lower, aside): the run folder is the ground, snapshots are written into it, sharding writes snapshots,
# diagnosis watches the processes, and the loop drives them all.
ENGINE_ROOMS = ["run_folder", "snapshots", "parallel", "diagnosis", "loop"]


def test_engines_rooms_import_only_the_rooms_below_them():
    def room(module: str) -> int | None:
        parts = module.split(".")
        return ENGINE_ROOMS.index(parts[2]) if parts[:2] == ["ddplab", "engine"] and len(parts) > 3 else None

    assert {m.split(".")[2] for m in modules() if m.count(".") > 2 and m.startswith("ddplab.engine.")} == set(
        ENGINE_ROOMS
    )
    upward = [
        f"{m} imports {t}"
        for m, targets in graph().items()
        for t in targets
        if room(m) is not None and room(t) is not None and room(t) > room(m)  # type: ignore[operator]
    ]
    assert upward == []


def test_no_import_cycles():
    edges, cycles = graph(), []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            walk(node, [node])
    # A package importing its own submodule is how Python packages work, not a cycle of design.
    cycles = [c for c in cycles if not all(part.startswith(c.split(" -> ")[0]) for part in c.split(" -> "))]
    assert cycles == []


def _is_import(text: str) -> bool:
    return text.strip().startswith(("import ", "from "))


def test_imports_inside_functions_say_why():
    """Start-up: the launcher and light commands must not pay for torch or a heavy optional library;
    such an import sits in the function that needs it, with a comment on its line or the line above."""
    silent = []
    for module, path in modules().items():
        lines = path.read_text().splitlines()
        for _, line, inside in imports(path, module):
            # A reason may head a block of imports, whose sections (stdlib, libraries, ddplab) the import sorter
            # parts with a blank line.
            first = line - 1
            while first > 0 and (
                _is_import(lines[first - 1])
                or not lines[first - 1].strip()
                and first > 1
                and _is_import(lines[first - 2])
            ):
                first -= 1
            block = lines[first - 1 : line]
            if inside and not any("#" in text for text in block):
                silent.append(f"{path.relative_to(SRC)}:{line}: {lines[line - 1].strip()}")
    assert sorted(set(silent)) == []
