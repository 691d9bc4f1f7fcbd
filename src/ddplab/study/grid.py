"""The study grid: setups (nodes x processes per node) times every combination of swept values."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from ddplab.errors import UserError
from ddplab.registry import load_config


@dataclass(frozen=True)
class Setup:
    """`nodes` launcher agents with `per_node` processes each."""

    nodes: int
    per_node: int

    @property
    def processes(self) -> int:
        return self.nodes * self.per_node

    @property
    def label(self) -> str:
        return f"{self.nodes}x{self.per_node}"


@dataclass
class Point:
    name: str  # the run folder: the grid point's name, then -r2, -r3... for further repeats
    setup: Setup
    swept: dict[str, str] = field(default_factory=dict)  # dotted key -> value, as typed
    overrides: list[str] = field(default_factory=list)  # everything passed to `ddplab train`
    repeat: int = 1
    point: str = ""  # the grid point's name, shared by its repeats


_SETUP = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(\d+)\s*$")


def parse_setups(text: str, nnodes: int = 1, option: str = "--nproc") -> list[Setup]:
    """'1,2,4' (processes per node, on `nnodes` nodes) or '1x1,1x4,2x2' (nodes x processes per node)."""
    setups = []
    for item in text.split(","):
        match = _SETUP.match(item)
        if not match:
            raise UserError(
                f"{option}: '{item.strip()}' is not a process count; use e.g. 1,2,4 or 1x4,2x2 (nodes x processes)"
            )
        nodes = int(match.group(1)) if match.group(1) else nnodes
        per_node = int(match.group(2))
        if nodes < 1 or per_node < 1:
            raise UserError(f"{option}: '{item.strip()}' must count at least one node and one process")
        setup = Setup(nodes, per_node)
        if setup not in setups:
            setups.append(setup)
    return setups


def parse_sweeps(items: list[str]) -> dict[str, list[str]]:
    """['training.batch_size=8,32', 'training.lr=1e-3,3e-3'] -> {key: [values]}."""
    sweeps: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--set '{item}' is not of the form key=v1,v2 (e.g. training.batch_size=8,32)")
        parts = [v.strip() for v in values.split(",")]
        if not all(parts):
            raise UserError(f"--set {key}: empty value in '{values}'; give values separated by commas")
        if key in sweeps:
            raise UserError(f"--set {key} given twice; list all its values once: {key}=v1,v2")
        sweeps[key] = list(dict.fromkeys(parts))
    return sweeps


def point_name(setup: Setup, swept: dict[str, str]) -> str:
    """n4 for 4 processes on one node, n2x2 for 2 nodes x 2; then each swept leaf name and value."""
    head = f"n{setup.per_node}" if setup.nodes == 1 else f"n{setup.nodes}x{setup.per_node}"
    slugs = [re.sub(r"[^A-Za-z0-9.+-]+", "-", v).strip("-") or "x" for v in swept.values()]
    return "-".join([head] + [f"{key.split('.')[-1]}_{slug}" for key, slug in zip(swept, slugs, strict=True)])


def expand(
    config: str | None,
    common: list[str],
    setups: list[Setup],
    sweeps: dict[str, list[str]],
    study_dir: str,
    repeat: int = 1,
) -> list[Point]:
    """Every run of the grid (each point `repeat` times, same seed), each point validated as
    `ddplab train` would before anything starts (`repeat` and the setups are checked by the command line)."""
    for item in common:
        if item.split("=", 1)[0].strip() in ("experiment.name", "experiment.output_dir"):
            raise UserError(f"'{item}': a study names its run folders itself; use --name and --output-dir")
    points = []
    for setup in setups:
        for values in itertools.product(*sweeps.values()):
            swept = dict(zip(sweeps, values, strict=True))
            name = point_name(setup, swept)
            overrides = [*common, *(f"{k}={v}" for k, v in swept.items()), f"experiment.output_dir={study_dir}"]
            # A bad value is one line naming the field, before any process starts.
            load_config(config, [*overrides, f"experiment.name={name}"])
            points.append(Point(name, setup, swept, overrides, point=name))
    # Repeats alternate (every point once, then every point again): a slow spell of a shared
    # machine then spreads over all points instead of landing on the repeats of one. The first
    # repeat keeps the point's own folder, so a study run once and then with --repeat 3 keeps that
    # run and adds two.
    return [
        Point(run, p.setup, p.swept, [*p.overrides, f"experiment.name={run}"], r, p.point)
        for r in range(1, repeat + 1)
        for p in points
        for run in [p.point if r == 1 else f"{p.point}-r{r}"]
    ]
