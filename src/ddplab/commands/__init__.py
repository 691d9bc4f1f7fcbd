"""One module per group of `ddplab` commands (a training job's, a trained model's, many runs'), imported by
ddplab.cli only when asked for. None imports torch at its top: `ddplab status` and the launcher start without it."""

from __future__ import annotations

from ddplab.errors import UserError


def split_args(items: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] [key=value ...]`: the first item without '=' is the config file."""
    config, overrides = None, []
    for item in items:
        if "=" in item:
            overrides.append(item)
        elif config is None:
            config = item
        else:
            raise UserError(f"unexpected argument '{item}': only one config file, then key=value overrides")
    return config, overrides


def at_least(name: str, value: float | None, least: float = 1, note: str = "") -> None:
    if value is not None and not value >= least:  # NaN too
        raise UserError(f"{name} must be >= {least}{note}, got {value}")
