"""The config tree, built and changed freely, then frozen once ddplab has read it: every field, option dict and
list then refuses change with FrozenInstanceError naming its dotted key; copies and pickles stay frozen."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")


class Section:
    """A section of the tree: its fields refuse change, naming the key, once `freeze` has run."""

    _prefix: str | None = None  # its dotted place ("training.") once frozen

    def __setattr__(self, name: str, value: Any) -> None:
        if self._prefix is not None:
            _refuse(f"{self._prefix}{name}")
        object.__setattr__(self, name, value)


def _refuse(dotted: str) -> None:
    raise FrozenInstanceError(
        f"the config is read-only once ddplab has read it: '{dotted}' cannot change (set it in the YAML, "
        f"an override, or on the Config before it is handed to ddplab)"
    )


class _Held:
    """A dict or list of a frozen config (data.options, logging.trackers): it refuses change, naming its key."""

    key = ""

    def _refused(self, *args, **kwargs) -> Any:
        _refuse(self.key)

    def __reduce__(self):  # copies and pickles built whole (dict or list of it), not item by item
        return type(self), (type(self).__bases__[1](self),), {"key": self.key}


class _HeldDict(_Held, dict):
    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _Held._refused


class _HeldList(_Held, list):
    __setitem__ = __delitem__ = __iadd__ = __imul__ = append = extend = insert = remove = pop = clear = _Held._refused
    sort = reverse = _Held._refused


def freeze(cfg: T) -> T:
    """`cfg`, made read-only in place (every section, option and list) and returned."""
    return _frozen(cfg, "")


def _frozen(value: Any, key: str) -> Any:
    if is_dataclass(value):
        prefix = f"{key}." if key else ""
        for f in fields(value):
            object.__setattr__(value, f.name, _frozen(getattr(value, f.name), prefix + f.name))
        object.__setattr__(value, "_prefix", prefix)
        return value
    held: _Held
    if isinstance(value, dict):
        held = _HeldDict({k: _frozen(v, f"{key}.{k}") for k, v in value.items()})
    elif isinstance(value, list):
        held = _HeldList([_frozen(v, f"{key}[{i}]") for i, v in enumerate(value)])
    else:
        return value
    held.key = key
    return held


def plain(value: Any) -> Any:
    """A frozen tree as plain dicts and lists (YAML, JSON, a weights_only checkpoint)."""
    if is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return [plain(v) for v in value] if isinstance(value, list) else value
