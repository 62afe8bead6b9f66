"""Typed loading of nested dataclasses from YAML files and dotted command-line overrides.

Generic machinery only (no knowledge of megaflex's sections): ``load_dataclass(cls, sources)``
merges mappings in order, checks every key against the dataclass fields, checks and coerces
every value against the field's type annotation, and names the offending key, the source it
came from (file path or ``command line``) and what is allowed when something is wrong.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A configuration value, key or combination that cannot be used."""


class _OutOfRange(ConfigError):
    """A number of the right type outside its key's range (not retried as another type of a union)."""


@dataclasses.dataclass(frozen=True)
class Range:
    """Allowed values of a float key (every float key must also be finite)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself excluded
    high_open: bool = True  # high itself excluded

    def contains(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high or (not self.high_open and value == self.high))

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"a finite float in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"a finite float {'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"a finite float {'<' if self.high_open else '<='} {self.high:g}"
        return "a finite float"


FINITE = Range()


@dataclasses.dataclass
class Source:
    """A mapping of config values and where it came from (for error messages)."""

    data: dict[str, Any]
    origin: str  # file path or "command line"


def read_yaml(path: str | Path) -> Source:
    """Read one YAML config file into a ``Source`` (the top level must be a mapping)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a YAML text file (invalid UTF-8 byte {e.object[e.start]:#04x} at byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    cycle = _self_reference(data, "", ())
    if cycle is not None:
        raise ConfigError(f"{path}: self-referential YAML alias at key {cycle!r} (an alias inside the node it names)")
    return Source(data, str(path))


def _self_reference(node: Any, key: str, ancestors: tuple[int, ...]) -> str | None:
    """Dotted key of the first node that contains itself (``a: &x {b: *x}``), else None."""
    if not isinstance(node, (dict, list)):
        return None
    if id(node) in ancestors:
        return key or "(top level)"
    ancestors = ancestors + (id(node),)
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in items:
        found = _self_reference(v, f"{key}.{k}" if key and isinstance(node, dict) else (f"{key}[{k}]" if key else str(k)), ancestors)
        if found is not None:
            return found
    return None


def parse_overrides(overrides: list[str]) -> Source:
    """``["train.lr=3e-4", "parallel.zero_stage=3"]`` -> nested mapping (values parsed as YAML)."""
    data: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command-line override {item!r}: expected section.key=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if any(not p for p in parts):
            raise ConfigError(f"command-line override {item!r}: empty component in key {key!r}")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"command-line override {item!r}: {p!r} is set both as a value and a section")
        node[parts[-1]] = yaml.safe_load(value) if value.strip() else ""
    return Source(data, "command line")


def load_dataclass(
    cls: type, sources: list[Source], float_ranges: dict[str, Range] | None = None
) -> tuple[Any, dict[str, str]]:
    """Build ``cls`` (a dataclass, possibly nested) from ``sources`` merged in order.

    Every float value must be finite and inside ``float_ranges[dotted key]`` (list items use their
    list's key), checked before any dataclass sees it. Returns the instance and ``origins``:
    dotted key -> the source that last set it.
    """
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for src in sources:
        _merge(merged, origins, src.data, src.origin, prefix="")
    return _build(cls, merged, origins, "", dict(float_ranges or {})), origins


def float_fields(cls: type, prefix: str = "") -> list[str]:
    """Dotted keys of every float-typed field of ``cls`` and its nested dataclasses
    (``float``, ``float | None``, ``list[float]``), for tables of ranges and their tests."""
    keys = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys += float_fields(tp, f"{prefix}{f.name}.")
        elif _mentions_float(tp):
            keys.append(f"{prefix}{f.name}")
    return keys


def _mentions_float(tp: Any) -> bool:
    return tp is float or any(_mentions_float(a) for a in get_args(tp))


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain nested dict (YAML/JSON serialisable)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> documentation, from ``field(metadata={"doc": ...})``."""
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def type_name(tp: Any) -> str:
    """Readable name of a type annotation, e.g. ``int | None`` or ``one of 'a', 'b'``."""
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(tp))
    if origin in (list, typing.List):
        (inner,) = get_args(tp) or (Any,)
        return f"list[{type_name(inner)}]"
    if origin in (dict, typing.Dict):
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


# --------------------------------------------------------------------------------------------
def _merge(dst: dict, origins: dict, src: dict, origin: str, prefix: str) -> None:
    for key, value in src.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], origins, value, origin, prefix=path + ".")
        else:
            dst[key] = _copy_tree(value)
            _record(origins, value, origin, path)


def _copy_tree(value: Any) -> Any:
    return {k: _copy_tree(v) for k, v in value.items()} if isinstance(value, dict) else value


def _record(origins: dict, value: Any, origin: str, path: str) -> None:
    origins[path] = origin
    if isinstance(value, dict):
        for k, v in value.items():
            _record(origins, v, origin, f"{path}.{k}")


def _build(cls: type, data: Any, origins: dict, prefix: str, ranges: dict[str, Range]) -> Any:
    where = origins.get(prefix.rstrip("."), "defaults")
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.')} (from {where}): expected a mapping (section), got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.metadata.get("internal")}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = f"{prefix}{unknown[0]}"
        raise ConfigError(
            f"unknown config key {key!r} (from {origins.get(key, where)}); "
            f"allowed keys in {prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        kwargs[name] = _coerce(hints[name], value, key, origins, ranges)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        # A dataclass's own check names its field first ("feature_dim must be ..."): report that
        # key's source (a command-line override of a key of a file's section came from the command line).
        named = re.match(r"\w+", str(e))
        if named and named.group(0) in fields and f"{prefix}{named.group(0)}" in origins:
            key = f"{prefix}{named.group(0)}"
            raise ConfigError(f"{key} (from {origins[key]}): {e}") from None
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} (from {where}): {e}") from None


def _coerce(tp: Any, value: Any, key: str, origins: dict, ranges: dict[str, Range]) -> Any:
    """Check ``value`` against annotation ``tp``; return it (ints widened to float, nested built)."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, origins, key + ".", ranges)
    if origin in (Union, types.UnionType):
        section_error = None  # a mapping for a `Section | None` key: the section's own error names the inner key
        for option in get_args(tp):
            try:
                return _coerce(option, value, key, origins, ranges)
            except _OutOfRange:
                raise
            except ConfigError as e:
                if dataclasses.is_dataclass(option) and isinstance(value, dict):
                    section_error = e
                continue
        if section_error is not None:
            raise section_error
        _fail(tp, value, key, origins)
    if origin is Literal:
        if value in get_args(tp) and type(value) in {type(a) for a in get_args(tp)}:
            return value
        _fail(tp, value, key, origins)
    if origin in (list, typing.List):
        (inner,) = get_args(tp) or (Any,)
        if not isinstance(value, list):
            _fail(tp, value, key, origins)
        return [_coerce(inner, v, f"{key}[{i}]", origins, ranges) for i, v in enumerate(value)]
    if origin in (dict, typing.Dict):
        if not isinstance(value, dict):
            _fail(tp, value, key, origins)
        for name, item in value.items():  # free-form mappings (feature_kwargs): floats must still be finite
            if isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(f"config key '{key}.{name}' (from {_origin_of(key, origins)}): expected a finite float, got {item!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
        _fail(tp, value, key, origins)
    if tp is bool:
        if isinstance(value, bool):
            return value
        _fail(tp, value, key, origins)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        _fail(tp, value, key, origins)
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            _fail(tp, value, key, origins)
        _check_range(number, key, origins, ranges)
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        _fail(tp, value, key, origins)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    _fail(tp, value, key, origins)


def _check_range(value: float, key: str, origins: dict, ranges: dict[str, Range]) -> None:
    rule = ranges.get(key.split("[", 1)[0], FINITE)
    if not (math.isfinite(value) and rule.contains(value)):
        raise _OutOfRange(f"config key {key!r} (from {_origin_of(key, origins)}): expected {rule.describe()}, got {value!r}")


def _fail(tp: Any, value: Any, key: str, origins: dict) -> typing.NoReturn:
    raise ConfigError(
        f"config key {key!r} (from {_origin_of(key, origins)}): expected {type_name(tp)}, got {value!r}"
    )


def _origin_of(key: str, origins: dict) -> str:
    key = key.split("[", 1)[0]
    while key:
        if key in origins:
            return origins[key]
        key = key.rsplit(".", 1)[0] if "." in key else ""
    return "defaults"
