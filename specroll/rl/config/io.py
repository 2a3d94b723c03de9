"""YAML settings for section/field dataclass configs: reading a file into a mapping,
`section.key=value` overrides, and building the dataclasses with each value checked
against its field's annotation. Errors name the file (and line), the section and field,
and list what is allowed."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import json
import math
import re
import shlex
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from specroll.inputs import printable, shown
from specroll.rl.config import yaml_safe
from specroll.rl.config.yaml_safe import YAMLTooLarge

MAX_EXACT_INT = 1 << 53
"""Largest integer a float setting takes: above it the float would round (and 10**400
would not convert at all)."""
_LONG_NUMBER = re.compile(r"\d{25,}")
"""A number too long to print whole in a refusal (10**400 has 401 digits)."""
MAX_CONFIG_BYTES = 1 << 20
"""Largest preset or --config file read: a configuration is a few kilobytes; a bigger file
is not one, and every byte of it would be copied into each checkpoint's meta.json."""


def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping of sections in YAML file `path`: not empty, not binary, at most
    MAX_CONFIG_BYTES, read as `yaml_safe.ConfigLoader` reads (no key twice, YAML 1.2
    numbers, aliases and nesting bounded)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text file ({e.reason} at byte {e.start})") from e
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from e
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(
            f"{path}: larger than {MAX_CONFIG_BYTES} bytes; a configuration is a few kilobytes"
        )
    try:
        raw = yaml_safe.load(text)
    except YAMLTooLarge as e:
        raise ValueError(f"{path}: {e}") from None
    except yaml.YAMLError as e:  # yaml's message names no file: say which, and where
        raise ValueError(f"{path}: not valid YAML{_yaml_where(e)}") from None
    if raw is None:
        raise ValueError(f"{path} is empty: it should map sections to settings")
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a mapping of sections, got {type(raw).__name__}")
    for section, values in raw.items():
        if values is not None and not isinstance(values, dict):
            raise ValueError(
                f"{path}: section {shown(section)} must be a mapping of keys to values, "
                f"got {type(values).__name__} {shown(values)}"
            )
    return raw


def _yaml_where(e: yaml.YAMLError) -> str:
    """' at line L, column C: problem (while parsing ... started at line M)' from a yaml
    error's marks (1-based), or ': message' when it carries none."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or not problem:
        return f": {' '.join(str(e).split())}"
    out = f" at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and cmark is not None:
        out += f" ({context} started at line {cmark.line + 1})"
    return out


def layer(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, field by field: a section `top` names keeps the fields of
    `base` it does not set (a user's file changes what it says, nothing else)."""
    out = {k: dict(v or {}) for k, v in base.items()}
    for section, values in top.items():
        out.setdefault(section, {}).update(values or {})
    return out


def field_docs(cls: type) -> tuple[str, dict[str, str]]:
    """(class docstring, {field: docstring}) of a dataclass whose fields carry a string
    literal under them, the convention of this project's configs (Python keeps no such
    attribute docstrings at run time, so they are read from the source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return inspect.getdoc(cls) or "", docs


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply 'section.key=value' strings (value parsed as YAML) to a raw mapping."""
    out = {k: dict(v or {}) for k, v in raw.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ValueError(f"--set expects section.key=value, got {item!r}")
        out.setdefault(section, {})[name] = set_value(key.strip(), text)
    return out


def set_value(key: str, text: str) -> Any:
    """The value of `--set key=text`, read as YAML; ValueError naming the flag, the value
    and how to pass it as a string when it is not YAML (a colon followed by a space, a
    leading @, %, `, !, or an unclosed bracket)."""
    try:
        return yaml_safe.load(text)
    except YAMLTooLarge as e:
        raise ValueError(f"--set {key}: {e}") from None
    except yaml.YAMLError as e:
        quoted = shlex.quote(f"{key}={json.dumps(text, ensure_ascii=False)}")
        raise ValueError(
            f"--set {key}={text!r}: the value is not valid YAML ({_problem(e)}); to pass it as "
            f"text, quote it in YAML and for the shell: --set {quoted}"
        ) from None


def _problem(e: yaml.YAMLError) -> str:
    """yaml's own words for what is wrong, without its marks (one line)."""
    words = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    return " ".join((f"{context}: {words}" if context else words).split())


def build_sections(raw: dict[str, Any], sections: dict[str, type]) -> dict[str, Any]:
    """{section: dataclass instance} from {section: {field: value}}; unknown names are
    errors, and each value is checked against its field's annotation."""
    check_names(raw, sections)
    kwargs = {}
    for name, values in (raw or {}).items():
        cls = sections[name]
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        args = {key: _coerce(f"{name}.{key}", v, fields[key]) for key, v in values.items()}
        kwargs[name] = cls(**args)
    return kwargs


def check_names(raw: dict[str, Any], sections: dict[str, type], where: str = "") -> None:
    """ValueError (prefixed with `where`, e.g. the file that says it) for a section or a
    field that does not exist, listing the ones that do."""
    at = f"{where}: " if where else ""
    for name, values in (raw or {}).items():
        if name not in sections:
            raise ValueError(
                f"{at}unknown config section {shown(name)}; sections: {', '.join(sections)}"
            )
        if not isinstance(values, dict):
            raise ValueError(
                f"{at}config section {shown(name)} must be a mapping, got {shown(values)}"
            )
        fields = [f.name for f in dataclasses.fields(sections[name])]
        for key in values:
            if key not in fields:
                raise ValueError(
                    f"{at}unknown config key {name}.{printable(key)}; "
                    f"{name} has: {', '.join(fields)}"
                )


def _coerce(where: str, value: Any, typ: Any) -> Any:
    """Check/convert a YAML value to a field's annotated type."""
    if isinstance(typ, str):
        typ = eval(typ, {"tuple": tuple, "int": int, "float": float, "str": str, "bool": bool})  # noqa: S307
    origin = typing.get_origin(typ)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list, got {shown(value)}")
        return tuple(_coerce(where, v, typing.get_args(typ)[0]) for v in value)
    if origin in (typing.Union, types.UnionType):
        return value
    if typ is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false, got {shown(value)}")
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > MAX_EXACT_INT:
            raise ValueError(f"{where} must be a finite number, got {shown(value)}")
        value = float(value)
    if typ is float and isinstance(value, str):  # a quoted number ('3e-3') is the number
        with contextlib.suppress(ValueError):
            value = float(value)
    if typ is str and not isinstance(value, str):  # YAML read the text as something else
        raise ValueError(
            f"{where} must be str, got {type(value).__name__} {shown(value)}: put text that YAML "
            "reads otherwise (a colon and a space, yes/no, a number) in quotes"
        )
    if typ in (int, float) and not (isinstance(value, typ) and not isinstance(value, bool)):
        raise ValueError(f"{where} must be {typ.__name__}, got {shown(value)}")
    if typ is float and not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {shown(value)}")
    return value


def check(cond: bool, msg: str) -> None:
    """ValueError(msg) unless cond: the one way a config section refuses a value."""
    if not cond:
        raise ValueError(_LONG_NUMBER.sub(lambda m: f"{m[0][:6]}...({len(m[0])} digits)", msg))


def bound(section: str, cfg: Any, name: str, low: float, above: bool = False) -> None:
    """ValueError naming `section.name` unless its value is >= low (> low: `above`)."""
    value = getattr(cfg, name)
    ok = value > low if above else value >= low
    check(ok, f"{section}.{name} must be {'>' if above else '>='} {low}, got {shown(value)}")


def one_of(section: str, cfg: Any, name: str, allowed: tuple) -> None:
    """ValueError naming `section.name` and the allowed values unless it is one of them."""
    value = getattr(cfg, name)
    check(value in allowed, f"{section}.{name} must be one of {allowed}, got {shown(value)}")
