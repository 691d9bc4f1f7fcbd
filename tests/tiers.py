"""The suite's tiers: every test is `unit`, `inproc` or `multiproc`, found from its code at collection.

- multiproc: the test, a fixture it uses, or a helper either calls (followed through every function and class
  defined under tests/) starts a process: the conftest helpers `ddplab()`, `torchrun()`, `verify()` and `run_study()`,
  `subprocess`, `multiprocessing`, `os.fork`.
- inproc: otherwise, if that code trains or runs a command in the pytest process (`ddplab.train`, the CLI's
  `main`, anything from ddplab.commands or ddplab.engine.loop.trainer) or joins a process
  group (the `one_rank_group` fixture).
- unit: the rest.

A marker written on a test, class or module (`pytestmark`) wins over the rule. So that a wrong guess cannot pass
unseen, a test not in the multiproc tier fails if it starts a Python process (git and the like are allowed).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
import types
from functools import cache
from pathlib import Path

import pytest

TIERS = ("unit", "inproc", "multiproc")
HERE = Path(__file__).resolve().parent
HEAVY_MODULES = (
    "ddplab.api",
    "ddplab.cli",
    "ddplab.commands",
    "ddplab.engine.loop.trainer",
)
IN_PROCESS_FIXTURES = {"one_rank_group"}


def _starters() -> set[int]:
    import multiprocessing

    import torch.multiprocessing

    import conftest

    return {
        id(o)
        for o in (
            subprocess,
            subprocess.run,
            subprocess.Popen,
            subprocess.check_output,
            subprocess.check_call,
            subprocess.call,
            multiprocessing,
            torch.multiprocessing,
            os.fork,
            os.system,
            os.posix_spawn,
            conftest.ddplab,
            conftest.torchrun,
            conftest.verify,
            conftest.run_study,
        )
    }


def _is_heavy(obj) -> bool:
    if isinstance(obj, types.ModuleType):
        name = obj.__name__
    else:
        name = getattr(obj, "__module__", None) or ""
    return any(name == m or name.startswith(m + ".") for m in HEAVY_MODULES) or (
        getattr(obj, "__name__", None) == "train" and name == "ddplab"
    )


def _ours(obj) -> bool:
    """A function or class whose code lives under tests/ (the helpers the walk follows)."""
    if not isinstance(obj, (types.FunctionType, type)):
        return False
    try:
        return Path(inspect.getsourcefile(obj) or "").resolve().is_relative_to(HERE)
    except TypeError:
        return False


def _referenced(obj) -> list:
    """The objects a function's or class's code names: plain names and dotted chains, resolved in its module."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return []
    fn = obj if isinstance(obj, types.FunctionType) else None
    scope = dict(vars(sys.modules.get(obj.__module__, types.ModuleType("x"))))
    if fn is not None:
        scope.update(fn.__globals__)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                scope[name] = cell.cell_contents
            except ValueError:  # not bound yet
                continue
    scope.update(_local_imports(tree))
    for node in ast.walk(tree):  # a name the code binds itself (an argument, an assignment) is not the module's
        if isinstance(node, ast.arg) or isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            scope.pop(node.arg if isinstance(node, ast.arg) else node.id, None)
    found = []
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in scope:
            continue
        target = scope[node.id]
        found.append(target)
        for attr in reversed(chain):
            target = getattr(target, attr, None)
            if target is None:
                break
            found.append(target)
    return found


def _local_imports(tree: ast.AST) -> dict:
    """What the `import` statements inside a function bind (tests import ddplab's parts where they need them).
    Only ddplab and what is imported already are looked at: importing mlflow or wandb here would cost seconds."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = _module(alias.name)
                if module is not None:
                    bound[alias.asname or alias.name.split(".")[0]] = (
                        module if alias.asname else sys.modules[alias.name.split(".")[0]]
                    )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            source = _module(node.module)
            for alias in node.names if source is not None else ():
                found = getattr(source, alias.name, None) or _module(f"{node.module}.{alias.name}")
                if found is not None:
                    bound[alias.asname or alias.name] = found
    return bound


def _module(name: str) -> types.ModuleType | None:
    if name in sys.modules:
        return sys.modules[name]
    if name.split(".")[0] != "ddplab":
        return None
    try:
        return importlib.import_module(name)
    except Exception:  # an optional library missing: no verdict from this import
        return None


@cache
def _kind(obj) -> str:
    """'multiproc', 'inproc' or 'unit' for the code of one function or class, helpers under tests/ included."""
    return _walk([obj], set())


def _walk(todo: list, seen: set[int]) -> str:
    starters, kind = _starters(), "unit"
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        for ref in _referenced(obj):
            if id(ref) in starters:
                return "multiproc"
            if kind == "unit" and _is_heavy(ref):
                kind = "inproc"
            if _ours(ref) and id(ref) not in seen:
                todo.append(ref)
    return kind


def tier_of(item: pytest.Item) -> str:
    """The tier the rule gives a test (a marker on it is not consulted here)."""
    code = [getattr(item, "function", None)]
    kind = "unit"
    for name in getattr(item, "fixturenames", ()):
        if name in IN_PROCESS_FIXTURES:
            kind = "inproc"
        defs = item._fixtureinfo.name2fixturedefs.get(name) if hasattr(item, "_fixtureinfo") else None
        if defs:
            code.append(defs[-1].func)
    for fn in code:
        if fn is None or not _ours(fn):
            continue
        found = _kind(fn)
        if found == "multiproc":
            return found
        if found == "inproc":
            kind = found
    return kind


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(tier_of(item))
    longest_first(items)


DURATIONS = HERE / "durations.json"  # each file's test seconds in a recent parallel pass: `make durations`


def longest_first(items: list[pytest.Item]) -> None:
    """Each file's tests together, the files that take longest first. xdist (--dist loadscope
    --no-loadscope-reorder, as the Makefile runs it) hands whole files to its workers in this order, each a new one
    as it runs out: the long files start at once and the short ones fill in at the end. Its default order, the
    files with the most tests first, started Ray's one 76-s test last, alone on one core."""
    known = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    counts: dict[str, list[int]] = {}
    for item in items:
        count = counts.setdefault(item.nodeid.split("::")[0], [0, 0])
        count[0 if item.get_closest_marker("multiproc") else 1] += 1
    # A file not in tests/durations.json yet: 5 s a multi-process test.
    weight = {path: known.get(path, 5.0 * multi + 0.05 * other) for path, (multi, other) in counts.items()}
    items.sort(key=lambda item: -weight[item.nodeid.split("::")[0]])


def write_durations(junit: Path) -> None:
    """tests/durations.json from a JUnit XML report of the suite (pytest --junitxml): each file's test seconds."""
    import xml.etree.ElementTree as ET

    seconds: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("classname", "").replace(".", "/") + ".py"  # tests.test_x: tests/test_x.py
        seconds[path] = seconds.get(path, 0.0) + float(case.get("time") or 0)
    ordered = dict(sorted(((p, round(s, 1)) for p, s in seconds.items()), key=lambda kv: -kv[1]))
    DURATIONS.write_text(json.dumps(ordered, indent=1) + "\n")


def _python(args) -> bool:
    """Whether a Popen's args start Python (or torchrun): what costs seconds to start, unlike git."""
    first = os.fsdecode(args if isinstance(args, (str, bytes, os.PathLike)) else next(iter(args), ""))
    program = first.split()[0] if first.strip() else first
    return program == sys.executable or os.path.basename(program).startswith(("python", "torchrun"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if item.get_closest_marker("multiproc"):
        return (yield)
    tier = next(t for t in TIERS if item.get_closest_marker(t))
    init = subprocess.Popen.__init__

    def refuse(self, args, *rest, **kwargs):
        if _python(args):
            pytest.fail(
                f"{item.nodeid} is in the {tier} tier but starts a Python process ({args!r}): mark it "
                f"@pytest.mark.multiproc",
                pytrace=False,
            )
        return init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = refuse
    try:
        return (yield)
    finally:
        subprocess.Popen.__init__ = init


_spent: dict[str, list] = {t: [set(), 0.0] for t in TIERS}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Adds up each tier's time: setup, call and teardown, on whichever worker ran them."""
    for tier in TIERS:
        if tier in report.keywords:
            _spent[tier][0].add(report.nodeid)
            _spent[tier][1] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not any(tests for tests, _ in _spent.values()):
        return
    parts = [f"{tier} {len(tests)} tests {seconds:.0f} s" for tier, (tests, seconds) in _spent.items() if tests]
    terminalreporter.write_line(f"tiers (test time, summed over workers): {'; '.join(parts)}")


if __name__ == "__main__":  # python tests/tiers.py REPORT.xml: tests/durations.json from a run's JUnit report
    write_durations(Path(sys.argv[1]))
