"""Typed loading of nested dataclasses from YAML files and dotted command-line overrides.

Generic machinery only (no knowledge of megaflex's sections): ``load_dataclass(cls, sources)``
merges mappings in order, checks every key against the dataclass fields, checks and coerces
every value against the field's type annotation, and names the offending key, the source it
came from (file path or ``command line``) and what is allowed when something is wrong.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A configuration value, key or combination that cannot be used."""


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
    return Source(data, str(path))


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


def load_dataclass(cls: type, sources: list[Source]) -> tuple[Any, dict[str, str]]:
    """Build ``cls`` (a dataclass, possibly nested) from ``sources`` merged in order.

    Returns the instance and ``origins``: dotted key -> the source that last set it.
    """
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for src in sources:
        _merge(merged, origins, src.data, src.origin, prefix="")
    return _build(cls, merged, origins, prefix=""), origins


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


def _build(cls: type, data: Any, origins: dict, prefix: str) -> Any:
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
        kwargs[name] = _coerce(hints[name], value, key, origins)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} (from {where}): {e}") from e


def _coerce(tp: Any, value: Any, key: str, origins: dict) -> Any:
    """Check ``value`` against annotation ``tp``; return it (ints widened to float, nested built)."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, origins, prefix=key + ".")
    if origin in (Union, types.UnionType):
        for option in get_args(tp):
            try:
                return _coerce(option, value, key, origins)
            except ConfigError:
                continue
        _fail(tp, value, key, origins)
    if origin is Literal:
        if value in get_args(tp) and type(value) in {type(a) for a in get_args(tp)}:
            return value
        _fail(tp, value, key, origins)
    if origin in (list, typing.List):
        (inner,) = get_args(tp) or (Any,)
        if not isinstance(value, list):
            _fail(tp, value, key, origins)
        return [_coerce(inner, v, f"{key}[{i}]", origins) for i, v in enumerate(value)]
    if origin in (dict, typing.Dict):
        if not isinstance(value, dict):
            _fail(tp, value, key, origins)
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
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        _fail(tp, value, key, origins)
    if tp is str:
        if isinstance(value, str):
            return value
        _fail(tp, value, key, origins)
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    _fail(tp, value, key, origins)


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
