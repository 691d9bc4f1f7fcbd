"""Retiring a public name: it keeps working for a release, and each use warns with its replacement (the rule:
docs/api.md). A name is added here when it goes, with the release it goes in."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any


def warn(old: str, new: str, until: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} is deprecated and goes in ddplab {until}: use {new}", DeprecationWarning, stacklevel)


def renamed(new: str, old: str, until: str) -> property:
    """A property `old` that warns and reads attribute `new` (removed in release `until`)."""

    def read(obj):
        owner = type(obj).__name__
        warn(f"{owner}.{old}", f"{owner}.{new}", until)
        return getattr(obj, new)

    return property(read, doc=f"Deprecated (goes in {until}): `{new}`.")


# retired config key -> (its replacement, the type the old key took, its value as the new key's, release it goes in)
KEYS: dict[str, tuple[str, type, Callable[[Any], Any], str]] = {
    "logging.tensorboard": ("logging.trackers", bool, lambda on: ["tensorboard"] if on else [], "0.3")
}


def renamed_key(dotted: str, value: Any, coerce: Callable[[Any, Any, str], Any]) -> tuple[str, Any]:
    """(the key that replaced `dotted`, `value` as that key reads it), with the warning."""
    new, kind, convert, until = KEYS[dotted]
    warn(f"config key {dotted}", new, until, stacklevel=4)
    return new, convert(coerce(value, kind, dotted))
