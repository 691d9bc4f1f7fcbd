"""One module per group of `ddplab` commands. Each imports only what it runs, so `ddplab status`
and the launcher side of `ddplab train` start without torch; ddplab.cli imports a command's
module only when that command is asked for."""

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


def positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UserError(f"{name} must be >= 1, got {value}")
