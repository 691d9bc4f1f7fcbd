"""One module per group of `ddplab` commands (a training job's, a trained model's, many runs'), imported by
ddplab.cli only when asked for. None imports torch at its top: `ddplab status` and the launcher start without it."""

from __future__ import annotations

from ddplab.errors import UserError


def split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] [key=value ...]`: the first item without '=' is the config file."""
    configs = [item for item in items if "=" not in item]
    if len(configs) > 1:
        raise UserError(f"unexpected argument '{configs[1]}': only one config file, then key=value overrides")
    return (configs[0] if configs else None), [item for item in items if "=" in item]


def at_least(name: str, value: float | None, least: float = 1, note: str = "") -> None:
    if value is not None and not value >= least:  # NaN too
        raise UserError(f"{name} must be >= {least}{note}, got {value}")
