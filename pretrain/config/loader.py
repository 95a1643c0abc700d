"""Typed, nested dataclass configs: YAML files plus dotted ``key=value`` overrides.

One schema (the dataclasses) is the only source of truth. Loading collects *every* problem (unknown
keys, wrong types, bad values, inconsistent combinations) and raises them together in one
:class:`ConfigError`, before any work (or process group) starts.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """All problems found in a configuration, one per line."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        # A line in parentheses is advice about the problems above it, not one more problem
        hints = [p for p in self.problems if p.startswith("(") and p.endswith(")")]
        found = [p for p in self.problems if p not in hints]
        lines = "\n".join([f"  - {p}" for p in found] + [f"  {h}" for h in hints])
        super().__init__(f"{len(found)} problem(s) in {source}:\n{lines}")


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str, problems: list[str]) -> Any:
    """Convert ``value`` to ``tp`` or record why not. Returns the converted value (or the input)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            trial: list[str] = []
            out = _coerce(value, arg, path, trial)
            if not trial:
                return out
        problems.append(f"{path}: expected {_type_name(tp)}, got {value!r}")
        return value
    if origin is Literal:
        if value not in get_args(tp):
            problems.append(f"{path}: must be one of {', '.join(repr(a) for a in get_args(tp))}; got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping for {tp.__name__}, got {value!r}")
            return tp()
        return _build(tp, value, path + ".", problems)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: expected a list, got {value!r}")
            return value
        (item_tp, *_) = get_args(tp) or (Any,)
        items = [_coerce(v, item_tp, f"{path}[{i}]", problems) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {value!r}")
        return dict(value) if isinstance(value, dict) else value
    if tp in _SCALARS:
        return _coerce_scalar(value, tp, path, problems)
    return value


def _coerce_scalar(value: Any, tp: type, path: str, problems: list[str]) -> Any:
    """bool, int (an integral float too), float (a number, or a string YAML left as one, e.g. "1e-4"), str."""
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
        return int(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, str):
        return value
    problems.append(f"{path}: expected {_SCALARS[tp]}, got {value!r}")
    return value


_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _dataclass_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(dataclasses.is_dataclass(v) for v in value)


def _build(cls: type[T], data: dict, prefix: str, problems: list[str]) -> T:
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in names:
            close = [n for n in names if n.startswith(str(key)[:3])]
            hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
            problems.append(f"{prefix}{key}: unknown key{hint}; known keys: {', '.join(sorted(names))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.init and f.name in data:
            before = len(problems)
            value = _coerce(data[f.name], hints[f.name], f"{prefix}{f.name}", problems)
            # A mistyped field keeps its default so the value checks still run on everything else.
            if len(problems) == before or dataclasses.is_dataclass(hints[f.name]) or _dataclass_list(value):
                kwargs[f.name] = value
    try:
        obj = cls(**kwargs)
    except TypeError as exc:  # a required field without a default
        problems.append(f"{prefix.rstrip('.') or cls.__name__}: {exc}")
        return None  # type: ignore[return-value]
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML so 3, 1e-4, true, [1,2] work)."""
    if "=" not in text:
        raise ConfigError([f"override {text!r}: expected dotted.key=value"], "command line")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError([f"override {text!r}: its value is not valid YAML ({_yaml_problem(exc)})"], "command line")
    return key.strip().split("."), value


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's complaint on one line, with where it was found (line and column from 1)."""
    mark = getattr(exc, "problem_mark", None)
    what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else what


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{path}: no such config file"], str(path))
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([f"{path}: not valid YAML: {_yaml_problem(exc)}"], str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot be read ({exc})"], str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: top level must be a mapping"], str(path))
    # `base: other.yaml` composes files (relative to this one); the including file wins.
    base = data.pop("base", None)
    if base:
        for b in [base] if isinstance(base, str) else base:
            data = merge(load_yaml(path.parent / b), data)
    return data


def build(cls: type[T], data: dict, overrides: list[str] = (), source: str = "config") -> T:
    """Build ``cls`` from a mapping plus overrides; every problem is reported at once."""
    problems: list[str] = []
    overridden: dict[str, str] = {}  # dotted key -> the override that set it
    for text in overrides:
        try:
            keys, value = parse_override(text)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        overridden[".".join(keys)] = text
        node = data
        for k in keys[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[keys[-1]] = value
    problems.extend(_renamed_problems(cls, data))
    obj = _build(cls, data, "", problems)
    if obj is not None:
        problems.extend(validate(obj))
    if problems:
        raise ConfigError(
            [_attribute(p, overridden) for p in problems], f"{source} with overrides" if overridden else source
        )
    return obj


def _pop_dotted(data: dict, dotted: str) -> tuple[bool, Any]:
    """Take ``a.b.c`` out of nested ``data``: (found, value)."""
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict) and last in node:
        return True, node.pop(last)
    return False, None


def _renamed_problems(cls: type, data: dict) -> list[str]:
    """A key ``cls.RENAMED`` maps to its new name: one line naming the new key (taken out of ``data``,
    so it is not also an unknown key)."""
    why = getattr(cls, "RENAMED_WHY", "a new name")
    return [
        f"{old}: renamed {new} ({why})" for old, new in getattr(cls, "RENAMED", {}).items() if _pop_dotted(data, old)[0]
    ]


def rename_keys(data: dict, renamed: dict[str, str]) -> dict:
    """``data`` (nested) with each dotted key of ``renamed`` moved to its new name, unless that is set."""
    data = copy.deepcopy(data)
    for old, new in renamed.items():
        found, value = _pop_dotted(data, old)
        if found:
            *new_parents, new_last = new.split(".")
            target = data
            for key in new_parents:
                target = target.setdefault(key, {})
            target.setdefault(new_last, value)
    return data


def _attribute(problem: str, overridden: dict[str, str]) -> str:
    """Name the command-line override behind a problem, so it is not blamed on the YAML file."""
    key = problem.split(":", 1)[0].strip()
    for dotted, text in overridden.items():
        if key == dotted or key.startswith(dotted + ".") or dotted.startswith(key + "."):
            return f"{problem} (from the override {text!r})"
    return problem


def load(cls: type[T], path: str | Path | None, overrides: list[str] = ()) -> T:
    data = load_yaml(path) if path else {}
    return build(cls, data, list(overrides), source=str(path or "config"))


def validate(obj: Any, prefix: str = "") -> list[str]:
    """Run every nested ``check()`` method; each returns a list of problem strings."""
    problems: list[str] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            problems.extend(validate(value, f"{prefix}{f.name}."))
        elif _dataclass_list(value):
            for i, item in enumerate(value):
                problems.extend(validate(item, f"{prefix}{f.name}[{i}]."))
    check = getattr(obj, "check", None)
    if callable(check):
        problems.extend(f"{prefix}{p}" for p in check())
    return problems


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def dump_yaml(obj: Any) -> str:
    """The config as YAML, a URL's credentials masked (``redact``): give them through the environment
    (``MLFLOW_TRACKING_URI``, the storage layer's AWS variables) where a process must have them."""
    return yaml.safe_dump(redact(to_dict(obj)), sort_keys=False)


_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def redact(value: Any) -> Any:
    """A URL's user and password (``https://user:token@host``) masked as ``***@``, in a string or in
    every string of a mapping, list or tuple: what the run writes (config.yaml, MLflow params, logs,
    the report) never holds them."""
    if isinstance(value, str):
        return _USERINFO.sub("***@", value)
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


class RedactingFilter(logging.Filter):
    """On a log handler: every record's message with URL credentials masked (``redact``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def setting(cls: type, path: str | Path, overrides: list[str], dotted: str) -> Any:
    """One setting of ``path`` with ``overrides``, without building or checking the rest: the YAML
    value, the last override of it, or the schema's default (None where the schema has no such key)."""
    value, found = load_yaml(path), True
    for key in dotted.split("."):
        found = found and isinstance(value, dict) and key in value
        value = value[key] if found else None
    for text in overrides:
        keys, override = parse_override(text)
        if ".".join(keys) == dotted:
            value, found = override, True
    if found:
        return value
    node: Any = cls()
    for key in dotted.split("."):
        if not dataclasses.is_dataclass(node) or not hasattr(node, key):
            return None
        node = getattr(node, key)
    return node
