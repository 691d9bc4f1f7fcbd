"""Reading a config: YAML (safe_load), dotted `key=value` overrides, types and ranges checked (names are
checked one level up, by ddplab.registry.load_config)."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from ddplab.config import INT_MAX, MAX_SECONDS, Config, deprecation, leaves
from ddplab.errors import UserError


def read_config(source: str | Path | dict | Config | None = None, overrides=()) -> Config:
    """A YAML path (None: the defaults), a dict or a Config, then dotted `key=value` overrides."""
    if source is None or isinstance(source, (str, Path)):
        tree = read_yaml(source) if source is not None else {}
    elif isinstance(source, (dict, Config)):
        tree = source.to_dict() if isinstance(source, Config) else source
    else:
        raise UserError(f"config: give a YAML path, a dict, a ddplab Config or None; got {type(source).__name__}")
    cfg = from_dict(_current_keys(tree))
    for item in overrides:
        apply_override(cfg, item)
    validate(cfg)
    return cfg


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"config file {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise UserError(f"cannot read config file {path}: {exc.strerror}") from None
    tree = load_yaml(text, f"config file {path}")
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise UserError(f"config file {path} must hold a mapping of sections, got {type(tree).__name__}")
    return tree


# A config is a few sections of a few keys: these bounds are far above any real one, and refuse a file
# nested deep enough to exhaust Python's recursion (thousands of levels) or an alias bomb (a few lines of
# anchors and aliases that expand to billions of values once anything walks the tree).
MAX_YAML_DEPTH = 100
MAX_YAML_NODES = 100_000


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with the nesting depth bounded and a key given twice in one mapping refused
    (PyYAML keeps the last silently); keys a merge (`<<: *anchor`) brings may be overridden."""

    depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise _Refused(f"is nested more than {MAX_YAML_DEPTH} levels deep", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    line = key_node.start_mark.line + 1
                    raise _Refused(f"gives the key {key!r} twice (lines {seen[key]} and {line})")
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


class _Refused(yaml.YAMLError):
    def __init__(self, what: str, mark=None) -> None:
        super().__init__(what)
        self.what, self.problem_mark = what, mark


def _expanded_size(node: yaml.Node, sizes: dict) -> int:
    """Values the tree holds once every alias is expanded: each node counted once per place it is used."""
    if id(node) in sizes and sizes[id(node)] is None:
        raise _Refused("holds itself (an alias inside its own anchor)", node.start_mark)
    if id(node) not in sizes:
        sizes[id(node)] = None  # being counted
        children = node.value if isinstance(node, yaml.CollectionNode) else []  # a scalar's value is its text
        if isinstance(node, yaml.MappingNode):
            children = [c for pair in children for c in pair]
        sizes[id(node)] = min(1 + sum(_expanded_size(c, sizes) for c in children), MAX_YAML_NODES + 1)
    return sizes[id(node)]


def load_yaml(text: str, what: str) -> Any:
    """YAML text (plain values only) with its depth and alias expansion bounded; `what` names it in errors."""
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_YAML_NODES:
            raise _Refused(f"expands to more than {MAX_YAML_NODES:,} values (YAML anchors and aliases)")
        return loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise UserError(f"{what} {getattr(exc, 'what', 'is not valid YAML')}{where}") from None
    finally:
        loader.dispose()


def from_dict(tree: dict, cls: type = Config, prefix: str = "") -> Any:
    """Typed construction: unknown keys and wrong types name the dotted field."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise UserError(f"unknown config key '{dotted}'; valid keys here: {', '.join(names)}")
        hint = hints[key]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            value = {} if value is None else value
            if not isinstance(value, dict):
                raise UserError(f"'{dotted}' must be a section (mapping), got {value!r}")
            kwargs[key] = from_dict(value, hint, dotted + ".")
        else:
            kwargs[key] = coerce(value, hint, dotted)
    return cls(**kwargs)


def _current_keys(tree: dict) -> dict:
    """Retired keys (deprecation.KEYS) moved to their replacements, with a warning each."""
    for dotted in deprecation.KEYS:
        section, key = dotted.rsplit(".", 1)
        node = tree.get(section)
        if isinstance(node, dict) and key in node:
            node = dict(node)
            new, value = deprecation.renamed_key(dotted, node.pop(key), coerce)
            tree = {**tree, section: {**node, new.rsplit(".", 1)[1]: value}}
    return tree


def apply_override(cfg: Config, item: str) -> None:
    if "=" not in item:
        raise UserError(f"override '{item}' is not of the form key=value (e.g. training.lr=3e-4)")
    dotted, raw = (part.strip() for part in item.split("=", 1))
    value: Any = raw
    if dotted in deprecation.KEYS:
        dotted, value = deprecation.renamed_key(dotted, raw, coerce)
    parts = dotted.split(".")
    node: Any = cfg
    for i, part in enumerate(parts):
        if isinstance(node, dict):  # data.options / model.options: free-form, values read as YAML (64 -> int)
            for key in parts[i:-1]:
                node = node.setdefault(key, {})
                if not isinstance(node, dict):
                    raise UserError(f"'{dotted}': {key} already holds a value, not a mapping")
            node[parts[-1]] = load_yaml(raw, f"'{dotted}'") if raw else None
            return
        if not dataclasses.is_dataclass(node):
            raise UserError(f"unknown config key '{dotted}'")
        names = [f.name for f in dataclasses.fields(node)]
        if part not in names:
            where = ".".join(parts[:i]) or "top level"
            raise UserError(f"unknown config key '{dotted}'; valid keys in {where}: {', '.join(names)}")
        if i == len(parts) - 1:
            hint = typing.get_type_hints(type(node))[part]
            if dataclasses.is_dataclass(hint):
                raise UserError(
                    f"'{dotted}' is a section; set one of its fields, "
                    f"e.g. {dotted}.{dataclasses.fields(hint)[0].name}=..."
                )
            setattr(node, part, coerce(value, hint, dotted))
        else:
            node = getattr(node, part)


# Null on the command line, for optional fields only: `training.amp=none` stays the choice "none".
NULL_WORDS = ("null", "none", "~")
TRUE_WORDS, FALSE_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


def coerce(value: Any, hint: Any, dotted: str) -> Any:
    """Convert YAML or command-line values to the field's declared type, or explain why not."""
    text = value.strip().lower() if isinstance(value, str) else None
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None or text in NULL_WORDS:
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if value is None or (hint is not str and text in NULL_WORDS):
        raise UserError(f"'{dotted}' may not be null; expected {getattr(hint, '__name__', hint)}")
    if hint is bool:
        if isinstance(value, bool) or text in TRUE_WORDS + FALSE_WORDS:
            return value if isinstance(value, bool) else text in TRUE_WORDS
        raise UserError(f"'{dotted}' must be true or false, got {value!r}")
    if hint in (int, float):
        return _number(value, text, hint, dotted)
    if hint is str:
        if isinstance(value, bool):  # YAML's true/false in a field of words
            return str(value).lower()
        if isinstance(value, (str, int, float)):
            return str(value)
        raise UserError(f"'{dotted}' must be a string, got {value!r}")
    if hint is list:  # names: `[a, b]` (YAML), `a,b` or `[]` on the command line
        if isinstance(value, str) and value.strip().startswith("["):
            value = load_yaml(value, f"'{dotted}'")
        elif isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(dict.fromkeys(value))
        raise UserError(f"'{dotted}' must be a list of names like [a, b], got {value!r}")
    if hint is dict:
        if isinstance(value, dict):
            return dict(value)
        raise UserError(f"'{dotted}' must be a mapping of free-form options, got {value!r}")
    raise UserError(f"'{dotted}' has an unsupported type {hint}")


def _number(value: Any, text: str | None, hint: type, dotted: str) -> int | float:
    """A finite number of the field's type: .nan, .inf, 1e400 and integers past INT_MAX are refused here."""
    kind = "an integer" if hint is int else "a number"
    number = value
    if text is not None and _NUMBER.match(text):
        number = int(text) if hint is int and text.lstrip("+-").isdigit() else float(text)
    if not isinstance(number, (int, float)) or isinstance(number, bool):
        raise UserError(f"'{dotted}' must be {kind}, got {value!r}")
    # 1e300: a YAML integer of 400 digits, which float() would overflow
    if (isinstance(number, float) and not math.isfinite(number)) or (hint is float and abs(number) > 1e300):
        raise UserError(f"'{dotted}' must be a finite number, got {_shown(value)}")
    if hint is float:
        return float(number)
    if isinstance(number, float):
        if not number.is_integer():
            raise UserError(f"'{dotted}' must be an integer, got {value!r}")
        number = int(number)
    if abs(number) > INT_MAX:
        raise UserError(f"'{dotted}' is out of range (at most {INT_MAX:.3g} in size), got {_shown(value)}")
    return number


def _shown(value: Any) -> str:
    """A value for a one-line message: a 400-digit number shortened."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def validate(cfg: Config) -> None:
    """Range and choice checks for every field, then cross-field checks."""
    _check_fields(cfg)
    parse_duration(cfg.training.time_budget, "training.time_budget")
    name = cfg.experiment.name  # one folder inside output_dir: no path of its own, nothing a terminal would act on
    if name is not None and (name in ("", ".", "..") or "/" in name or "\\" in name or not name.isprintable()):
        raise UserError(
            f"experiment.name: {name!r} is not a plain folder name (one path component: no '/', no '..' "
            f"or '.', no control characters)"
        )
    if cfg.checkpoint.resume not in ("auto", "never") and not Path(cfg.checkpoint.resume).exists():
        raise UserError(f"checkpoint.resume: '{cfg.checkpoint.resume}' is neither auto, never nor an existing snapshot")
    if cfg.model.dim % cfg.model.heads:
        raise UserError(f"model.dim ({cfg.model.dim}) must be divisible by model.heads ({cfg.model.heads})")
    if cfg.model.dropout >= 1:
        raise UserError(f"model.dropout must be in [0, 1), got {cfg.model.dropout}")
    for name in ("val_fraction", "test_fraction"):
        if not 0 <= getattr(cfg.data, name) < 1:
            raise UserError(f"data.{name} must be in [0, 1), got {getattr(cfg.data, name)}")


def _check_fields(cfg: Config) -> None:
    for dotted, f, value in leaves(cfg):
        meta = f.metadata
        for item in value if isinstance(value, list) else [value]:  # a list's every item is one of the choices
            if meta.get("choices") is not None and item not in meta["choices"]:
                allowed = ", ".join(str(c) for c in meta["choices"] if c is not None)
                raise UserError(f"'{dotted}' must be one of {allowed}; got {item!r}")
        if value is None or isinstance(value, (bool, str, dict, list)):
            continue
        if meta.get("positive") and value <= 0:
            raise UserError(f"'{dotted}' must be > 0, got {value}")
        if meta.get("min") is not None and value < meta["min"]:
            raise UserError(f"'{dotted}' must be >= {meta['min']}, got {value}")
        if meta.get("max") is not None and value > meta["max"]:
            raise UserError(f"'{dotted}' must be <= {meta['max']}, got {value}")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")


def parse_duration(text: str | None, dotted: str = "duration") -> float | None:
    """'2h', '90m', '30s', '45' (seconds) -> seconds."""
    if text is None:
        return None
    match = _DURATION.match(str(text))
    if not match:
        raise UserError(f"'{dotted}' must be a duration like 2h, 90m, 30s; got {_shown(text)}")
    number, unit = float(match.group(1)), match.group(2) or "s"
    seconds = number * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
    if seconds <= 0:
        raise UserError(f"'{dotted}' must be positive; got {_shown(text)}")
    if seconds > MAX_SECONDS:  # also a 400-digit number, read as inf
        raise UserError(f"'{dotted}' must be at most {MAX_SECONDS // 86400}d; got {_shown(text)}")
    return seconds


def format_duration(seconds: float) -> str:
    """1h02m, 3m10s, 42s: elapsed times and ETAs as people read them."""
    s = max(int(round(seconds)), 0)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
