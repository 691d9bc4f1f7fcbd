"""Which config changes an unfinished run may be continued under: SAFE_TO_CHANGE, the fields that change how long,
where, how loudly or how fast a run goes, never what it computes per step. The run's own config is its newest
snapshot's (whatever became of config.yaml since), else config.yaml's."""

from __future__ import annotations

from pathlib import Path

import yaml

from ddplab.engine.snapshots.manifest import newest
from ddplab.errors import UserError

# Dotted fields, or whole sections ending in ".". Kept in one place; docs/config.md is generated from it.
SAFE_TO_CHANGE = (
    "training.epochs",  # extend (or shorten) the run; the schedule's length follows it
    "training.max_steps",
    "training.time_budget",
    "training.keep_host_memory",
    "logging.",
    "generate.",
    "data.num_workers",
    "data.pin_memory",
    "data.cache_dir",
    "data.cache",  # raw and false read the same pixels; jpeg re-encodes them once at quality 90
    "experiment.repeats",  # read by `ddplab study` only
    "distributed.timeout",
    "distributed.backend",
    "distributed.lighthouse",  # the replica groups' coordinator: `--replica-groups` picks a port per launch
    "training.batch_size",  # with grad_accum_steps: a resume keeps the run's global batch (engine/loop/resume.py)
    "training.grad_accum_steps",
    "checkpoint.async_save",
    "checkpoint.checksums",
    "checkpoint.allow_changed_data",
    "checkpoint.every",
    "checkpoint.keep_last",
    "checkpoint.resume",
    "experiment.output_dir",  # the folder was found by these two: a moved or renamed folder is the same run
    "experiment.name",
)


def safe(dotted: str) -> bool:
    return any(dotted == s or (s.endswith(".") and dotted.startswith(s)) for s in SAFE_TO_CHANGE)


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differences(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(field, old, new) for every field that differs and is not safe to change, in config order."""
    a, b = flatten(old), flatten(new)
    keys = list(b) + [k for k in a if k not in b]
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k) and not safe(k)]


def check_resume(run_dir: Path, new: dict) -> None:
    """Refuse (UserError) to continue the unfinished run in `run_dir` under a config that changes what it computes."""
    snapshot = newest(Path(run_dir) / "checkpoints")
    stored = Path(run_dir) / "config.yaml"
    if snapshot is not None and isinstance(snapshot.get("config"), dict):
        old = snapshot["config"]
    elif not stored.is_file():
        return  # a folder without a recorded config holds no run to protect
    else:
        try:
            old = yaml.safe_load(stored.read_text())
        except (OSError, yaml.YAMLError):
            old = None
    if not isinstance(old, dict):
        raise UserError(
            f"{stored} is unreadable, so the unfinished run there cannot be checked; "
            "start a new run with experiment.name=... or checkpoint.resume=never"
        )
    diff = differences(old, new)
    if diff:
        shown = ", ".join(f"{k}: {v!r} -> {w!r}" for k, v, w in diff[:3])
        if len(diff) > 3:
            shown += f" (+{len(diff) - 3} more)"
        raise UserError(
            f"{run_dir} holds an unfinished run with another config ({shown}); rerun with its config to "
            "continue it, or start a new run with experiment.name=... or checkpoint.resume=never"
        )


def check_resume_path(path: str, model) -> None:
    """An explicit checkpoint.resume=PATH must be a loadable snapshot of this model's shape."""
    if path in ("auto", "never"):
        return
    from ddplab.engine.snapshots.read import load_snapshot, same_model  # torch: only when resuming from a snapshot

    snap = load_snapshot(path, weights=False)
    same_model(path, model.state_dict(), snap["model"], "checkpoint.resume: ")
