"""Retiring a public name: it keeps working for a release, and each use warns with its replacement.

One mechanism for every name: `renamed(new, old)` makes `old` a read-only property that reads `new` with a
DeprecationWarning naming it. A name is added here when it goes, with the release it goes in.
"""

from __future__ import annotations

import warnings


def renamed(new: str, old: str, until: str) -> property:
    """A property `old` that warns and reads attribute `new` (removed in release `until`)."""

    def read(obj):
        owner = type(obj).__name__
        warnings.warn(
            f"{owner}.{old} is deprecated and goes in ddplab {until}: use {owner}.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(obj, new)

    return property(read, doc=f"Deprecated (goes in {until}): `{new}`.")
