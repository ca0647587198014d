"""Turn YAML files and dotted CLI overrides into a validated ``JobConfig``.

Precedence: command line > YAML > dataclass defaults. Every value is checked against the
field's type annotation; an unknown key fails with the closest valid key.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from moetune.recipe.config import FALSE_SPELLINGS, TRUE_SPELLINGS, JobConfig, validate


def load_config(*, yaml_path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults, then the YAML file, then ``overrides`` (``["--optim.lr", "1e-5", ...]`` or
    ``["optim.lr=1e-5"]``), validated."""
    values: dict[str, tuple[Any, str]] = {}
    if yaml_path is not None:
        values.update(_flatten(_read_yaml(Path(yaml_path)), source=str(yaml_path)))
    values.update(parse_overrides(overrides or []))
    return validate(build(JobConfig, values))


def parse_overrides(args: list[str]) -> dict[str, tuple[str, str]]:
    """``--a.b 1 --c.d=2 e.f=3`` -> {"a.b": ("1", "command line"), ...}."""
    out: dict[str, tuple[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        key = arg[2:] if arg.startswith("--") else arg
        if "=" in key:
            key, value = key.split("=", 1)
        elif arg.startswith("--") and i + 1 < len(args):
            i += 1
            value = args[i]
        else:
            raise ValueError(f"command line: {arg!r} needs a value (--section.field VALUE)")
        out[key.replace("-", "_")] = (value, "command line")
        i += 1
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"config file {path} is not valid YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _flatten(data: dict[str, Any], *, source: str, prefix: str = "") -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, source=source, prefix=f"{dotted}."))
        else:
            out[dotted] = (value, source)
    return out


def all_keys(cls: type = JobConfig, prefix: str = "") -> list[str]:
    """Every settable dotted key of ``cls``, e.g. ``optim.lr``."""
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            keys += all_keys(hint, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def build(cls: type, values: dict[str, tuple[Any, str]], prefix: str = "") -> Any:
    """Instantiate dataclass ``cls`` from flat dotted ``values`` (key -> (value, source))."""
    if not prefix:
        valid = set(all_keys(cls))
        for key, (_, source) in values.items():
            if key not in valid:
                close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"unknown config key {key!r} (from {source}){hint}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        dotted = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], values, f"{dotted}.")
        elif dotted in values:
            value, source = values[dotted]
            kwargs[f.name] = coerce(value, hints[f.name], name=dotted, source=source)
    try:
        return cls(**kwargs)
    except ValueError as err:  # a section's own checks (e.g. LoraSettings.__post_init__)
        raise ValueError(f"config section {prefix.rstrip('.') or 'root'}: {err}") from err


NULL_SPELLINGS = ("null", "none", "~")
"""How null may be written on the command line (lower case): YAML's spellings, and Python's."""


def coerce(value: Any, hint: Any, *, name: str, source: str) -> Any:
    """Convert ``value`` (from YAML or a CLI string) to type ``hint`` or raise ValueError. Null (YAML's
    null / ``~`` / an empty value, or ``null`` / ``none`` / ``~`` on the command line) is None for an
    optional field and "" for a text field (``--data.test_path null``: no held-out set)."""

    def fail(expected: str) -> typing.NoReturn:
        raise ValueError(f"config field {name}: expected {expected}, got {value!r} (from {source})")

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    # YAML's null (``key: null``, ``key: ~`` or ``key:`` with nothing after it) arrives as None, the
    # command line's as a word: both mean "empty", never the string "None".
    if value is None or (isinstance(value, str) and value.lower() in NULL_SPELLINGS):
        if origin in (typing.Union, types.UnionType) and type(None) in args:
            return None
        if hint is str:
            return ""
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        assert len(inner) == 1, f"unsupported union in schema: {hint}"
        return coerce(value, inner[0], name=name, source=source)
    if origin in (list, tuple):
        if isinstance(value, str):
            parsed = yaml.safe_load(value) if value.strip().startswith("[") else value.split(",")
            value = parsed if isinstance(parsed, list) else fail("a list")
        if not isinstance(value, (list, tuple)):
            fail("a list")
        item_types = args if origin is tuple and Ellipsis not in args else (args[0],) * len(value)
        if len(item_types) != len(value):
            fail(f"{len(item_types)} values")
        items = [coerce(v, t, name=name, source=source) for v, t in zip(value, item_types)]
        return tuple(items) if origin is tuple else items
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in TRUE_SPELLINGS | FALSE_SPELLINGS:
            return str(value).lower() in TRUE_SPELLINGS
        fail("true or false")
    if hint is int:
        if isinstance(value, bool):
            fail("an integer")
        try:
            as_float = float(value)
        except (TypeError, ValueError):
            fail("an integer")
        if not as_float.is_integer():
            fail("an integer")
        return int(as_float)
    if hint is float:
        if isinstance(value, bool):
            fail("a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            fail("a number")
    if hint is str:
        if isinstance(value, (dict, list)):
            fail("a string")
        return str(value)
    raise AssertionError(f"unsupported type in schema: {hint}")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (attribute docstrings, read from source)."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):  # base first
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls: type = JobConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, doc) for every field, for ``--help``."""
    rows = []
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", repr(getattr(defaults, f.name)), docs.get(f.name, "")))
    return rows


def to_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as nested plain dicts and lists (tuples become lists), for YAML/JSON."""
    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value
    return plain(dataclasses.asdict(config))


def save_config(config: JobConfig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
