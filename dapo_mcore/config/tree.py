"""Typed dataclass trees from YAML: strict loading, dotted overrides, and errors that name the fix.

Generic machinery only; the project's own tree lives in ``config.py``. Loading checks every key against the
dataclass fields (unknown keys get a "did you mean" suggestion), every value against the field's type, and
never falls back silently to a default for a value it could not read.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

T = TypeVar("T")
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class ConfigError(ValueError):
    """A configuration problem the user must fix; the message names the key and the fix."""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        return f"list of {_type_name(get_args(tp)[0])}" if get_args(tp) else "list"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it (ints and numeric strings such as 5e-4 widen to floats; nothing else converts)."""
    origin = get_origin(tp)
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {_type_name(tp)}.")
    if origin in (Union, types.UnionType):
        errors = []
        for option in get_args(tp):
            try:
                return _coerce(value, option, key)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {_type_name(tp)}.")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}={value!r}: expected null.")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list ({_type_name(tp)}).")
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} fields, got {value!r}.")
        return from_dict(tp, value, prefix=key)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if tp is float and isinstance(value, str) and _FLOAT_RE.match(value.strip()):
        value = float(value)  # YAML 1.1 reads "5e-4" (no dot) as a string
    if tp is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} is not a finite number (YAML reads .inf, .nan and values past ~1.8e308 "
                          "such as 1e309 as infinity or NaN); give a finite value.")
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected true or false.")
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected a number, not a boolean.")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{key}={value!r}: expected {_type_name(tp)}, got {type(value).__name__}.")
    return value


def _unknown_key_error(cls: type, key: str, prefix: str) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    full = f"{prefix}.{key}" if prefix else key
    close = difflib.get_close_matches(key, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {full!r}.{hint} Valid keys here: {', '.join(names)}.")


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, recursively, rejecting unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key_error(cls, key, prefix)
        full = f"{prefix}.{key}" if prefix else key
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    """Plain-dict form of a dataclass tree (tuples become lists), for YAML output."""
    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value
    return plain(obj)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into the key path and the YAML-parsed value."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value (e.g. algo.clip_high=0.28).")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key; write section.key=value.")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({_yaml_problem(exc)}).") from exc
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``key=value`` overrides to a nested mapping (a copy is returned)."""
    import copy

    out = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is a value, not a section.")
            node = child
        node[path[-1]] = value
    return out


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a YAML error (PyYAML's own text spans several lines with a source excerpt)."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def _refuse_duplicate_keys(node: yaml.Node | None, path: Path, prefix: str = "") -> None:
    """PyYAML keeps the last of two equal keys in a mapping: a second ``algo:`` block would silently replace the
    first. Walk the composed document and refuse any key given twice, naming it and both lines."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, path, f"{prefix}[{i}]")
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key, line = key_node.value, key_node.start_mark.line + 1
        full = f"{prefix}.{key}" if prefix else key
        if key in seen:
            raise ConfigError(f"config file {str(path)!r}: key {full!r} appears twice (lines {seen[key]} and {line}); "
                              "YAML would keep only the second, so merge the two into one.")
        seen[key] = line
        _refuse_duplicate_keys(value_node, path, full)


MAX_YAML_NODES = 100_000
"""A config file expands to at most this many YAML nodes (a recipe has a few hundred): aliases of aliases (a
"billion laughs" file) would otherwise take minutes and gigabytes to walk."""


def _refuse_alias_bomb(root: yaml.Node | None, path: Path) -> None:
    """Count the nodes the document expands to (each alias counted as often as it is used), memoised per node so
    the count itself stays linear in the file; ConfigError past MAX_YAML_NODES or on a recursive alias."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in active:
            raise ConfigError(f"config file {str(path)!r} holds a recursive YAML alias; write the values out.")
        active.add(id(node))
        children = (node.value if isinstance(node, yaml.SequenceNode) else
                    [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_YAML_NODES:
                raise ConfigError(f"config file {str(path)!r} expands to more than {MAX_YAML_NODES:,} YAML nodes "
                                  "through its aliases (&anchor / *alias); a config is a few hundred: write the "
                                  "values out.")
        active.discard(id(node))
        sizes[id(node)] = total
        return total

    if root is not None:
        size(root)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that say what is wrong with the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass the path of a YAML config "
                          f"(e.g. examples/tiny_cpu.yaml).")
    try:
        text = p.read_text(encoding="utf-8")
        document = yaml.compose(text, Loader=yaml.SafeLoader)
        _refuse_alias_bomb(document, p)
        _refuse_duplicate_keys(document, p)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {_yaml_problem(exc)}.") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}).") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections, not {type(data).__name__}.")
    return data
