"""Names in `reward.functions`: a built-in, a file's function or a module's function.

A reference is a built-in name (`math`, `exact_match`, `format`), `path/to/file.py:fn`
(relative to the working directory) or `package.module:fn` (importable from the working
directory or the Python path). `check` validates them before any model is loaded without
running the user's code: the file or module must exist and define `fn` at its top level
(read from its syntax tree; the module's packages are found, not imported). `load` imports
them, and runs in the reward worker (`reward_worker`), never in the trainer's process.
The same function named twice (`rw/x.py:f` and `./rw/x.py:f`) is refused, as it would be
counted twice. `check_value` is the one rule for what a reward function may return: a
finite number within MAX_REWARD, or a dict of at most MAX_COMPONENTS of them under short
names (each becomes a metric).
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import math
import numbers
import os
import re
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specroll.tasks.files import special_kind
from specroll.tasks.reward import BUILTINS, builtin

SIGNATURE = "fn(prompt: str, completion: str, record: dict) -> float | dict[str, float]"
"""The one signature of a reward function."""
MAX_REWARD = 1e6
"""The largest |value| a function (or a component) may return: far beyond any sensible
reward, and small enough that weighted sums and advantages stay finite."""
MAX_COMPONENTS = 32
"""The most named components a function may return (over a step's samples too): each is
a metric of its own."""
COMPONENT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
"""A component's name: a letter or '_', then letters, digits, '_', '.', '-' (at most 32
characters): it becomes part of a metric name in every logger."""
MAX_SOURCE_BYTES = 4 << 20
"""The largest reward file the check reads (a module of Python source, not data)."""


@dataclass(frozen=True)
class Ref:
    """One entry of `reward.functions`, parsed."""

    text: str
    """As the user wrote it."""
    target: str
    """The built-in name, the file path or the dotted module."""
    function: str
    """The function's name ('' for a built-in)."""

    @property
    def builtin(self) -> bool:
        return not self.function

    @property
    def is_file(self) -> bool:
        return self.target.endswith(".py") or "/" in self.target or os.sep in self.target

    @property
    def name(self) -> str:
        """Short name for metrics: the built-in's or the function's."""
        return self.function or self.target


def parse(text: str) -> Ref:
    """A reference from its text; ValueError naming it and what is allowed."""
    target, colon, function = text.strip().rpartition(":")
    if not colon:
        if text not in BUILTINS:
            raise ValueError(
                f"reward.functions: unknown built-in reward {text!r}; built-ins: "
                f"{', '.join(BUILTINS)}, or a function as 'path/to/file.py:function' or "
                f"'package.module:function'"
            )
        return Ref(text, text, "")
    if not target or not function.isidentifier():
        raise ValueError(
            f"reward.functions: {text!r} must be 'path/to/file.py:function' or "
            f"'package.module:function' (function: a Python name)"
        )
    return Ref(text, target, function)


def names(refs: list[Ref]) -> list[str]:
    """Metric names of the functions: short names, or the full references when two
    functions share a short name."""
    short = [r.name for r in refs]
    return short if len(set(short)) == len(short) else [r.text for r in refs]


def check(texts: tuple[str, ...] | list[str]) -> list[Ref]:
    """Parse and validate `reward.functions` without running user code."""
    if not texts:
        raise ValueError("reward.functions must name at least one reward function")
    refs = [parse(t) for t in texts]
    seen = [r.text for r in refs]
    twice = sorted({t for t in seen if seen.count(t) > 1})
    if twice:
        raise ValueError(f"reward.functions names {', '.join(twice)} more than once")
    where: dict[tuple[str, str], Ref] = {}
    for r in refs:
        key = (r.target, "")
        if not r.builtin:
            path = source(r)
            _check_defined(r, path)
            key = (str(path.resolve()) if path is not None else r.target, r.function)
        if key in where:
            raise ValueError(
                f"reward.functions names one function twice: {where[key].text!r} and "
                f"{r.text!r} are both {r.function!r} of {key[0]}; list it once (a weight in "
                f"reward.weights counts it more)"
            )
        where[key] = r
    return refs


def source(ref: Ref) -> Path | None:
    """The file that defines `ref` (None: a module without Python source to read)."""
    if ref.is_file:
        path = Path(ref.target)
        try:
            mode = path.stat().st_mode
        except OSError:
            raise ValueError(f"reward.functions: {ref.text!r}: no such file {path}") from None
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else special_kind(path)
            raise ValueError(
                f"reward.functions: {ref.text!r}: {path} is {kind or 'not a regular file'}, "
                "not a Python file"
            )
        return path
    spec = None
    search = [os.getcwd(), *sys.path]
    parts = ref.target.split(".")
    for i in range(len(parts)):  # find each package in turn, importing none of them
        name = ".".join(parts[: i + 1])
        spec = importlib.machinery.PathFinder.find_spec(name, search)
        if spec is None and i == 0:
            spec = importlib.util.find_spec(name)  # built-in and frozen modules
        if spec is None and i > 0 and not search:
            parent = ".".join(parts[:i])
            raise ValueError(
                f"reward.functions: {ref.text!r}: {parent!r} is a module, not a package, so "
                f"{name!r} is no module file of its own (a name {parent!r} may set when "
                f"imported, as os.path is; the check runs no code to find it): name the "
                f"module that defines the function, or its file as 'path/to/file.py:function'"
            )
        if spec is None:
            raise ValueError(
                f"reward.functions: {ref.text!r}: no module {name!r} (looked in the working "
                f"directory and the Python path)"
            )
        search = list(spec.submodule_search_locations or [])
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


def _check_defined(ref: Ref, path: Path | None) -> None:
    """ValueError unless the file defines `ref.function` at its top level (a star import
    or a source-less module is given the benefit of the doubt)."""
    if path is None:
        return
    try:
        size = path.stat().st_size
        if size > MAX_SOURCE_BYTES:
            raise ValueError(
                f"reward.functions: {ref.text!r}: {path} holds {size} bytes, more than a "
                f"reward module may ({MAX_SOURCE_BYTES >> 20} MiB)"
            )
        tree = ast.parse(path.read_text(), str(path))
    except SyntaxError as e:
        raise ValueError(
            f"reward.functions: {ref.text!r}: {path} is not valid Python (line {e.lineno}: {e.msg})"
        ) from None
    except (RecursionError, MemoryError) as e:  # e.g. an expression of 200,000 terms
        raise ValueError(
            f"reward.functions: {ref.text!r}: {path} is nested too deeply for Python to "
            f"parse ({type(e).__name__}); split its long expressions"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"reward.functions: {ref.text!r}: cannot read {path} ({e})") from None
    defined, star = _top_level_names(tree.body)
    if ref.function not in defined and not star:
        listed = ", ".join(sorted(n for n in defined if not n.startswith("_"))) or "none"
        raise ValueError(
            f"reward.functions: {ref.text!r}: {path} defines no {ref.function!r} "
            f"(its top-level names: {listed})"
        )


def _top_level_names(body: list[ast.stmt]) -> tuple[set[str], bool]:
    """Names a module body binds (into if/try/with blocks too), and whether it star-imports."""
    out: set[str] = set()
    star = False
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for a in node.names:
                star |= a.name == "*"
                out.add(a.asname or a.name.split(".")[0])
        else:  # if / try / with blocks at the top level bind names too
            inner = [*getattr(node, "body", []), *getattr(node, "orelse", [])]
            inner += [*getattr(node, "finalbody", [])]
            inner += [x for h in getattr(node, "handlers", []) for x in h.body]
            names, s = _top_level_names([x for x in inner if isinstance(x, ast.stmt)])
            out |= names
            star |= s
    return out, star


def load(ref: Ref, index: int) -> Callable:
    """The function: a built-in, or the user's imported (runs the user's module: call
    this in the worker)."""
    if ref.builtin:
        return builtin(ref.target)
    if ref.is_file:
        path = Path(ref.target).resolve()
        sys.path.insert(0, str(path.parent))  # its sibling modules import as they would
        spec = importlib.util.spec_from_file_location(f"specroll_reward_{index}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(ref.target)
    fn = getattr(module, ref.function, None)
    if not callable(fn):
        raise TypeError(f"{ref.target} has no function {ref.function!r}")
    return fn


def check_value(value) -> float | dict[str, float]:
    """What a reward function returned, as a float or a {name: float} dict; TypeError or
    ValueError saying what is wrong with it."""
    if isinstance(value, dict):
        if not value:
            raise TypeError("returned an empty dict (expected {name: float, ...})")
        if len(value) > MAX_COMPONENTS:
            raise ValueError(
                f"returned a dict of {len(value)} components, more than {MAX_COMPONENTS} "
                f"(each is a metric)"
            )
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"returned a dict with a key that is not a string: {_short(repr(k))}"
                )
            if not COMPONENT_NAME.fullmatch(k):
                raise ValueError(
                    f"returned a component named {_short(repr(k))}: a component's name is a "
                    f"metric's, a letter or '_' then letters, digits, '_', '.' or '-' (at most "
                    f"32 characters)"
                )
            out[k] = _number(v, f"component {k!r} is ")
        return out
    return _number(value, "returned ")


def _number(value, what: str) -> float:
    if not isinstance(value, numbers.Real):  # bool, int, float and NumPy's real scalars
        raise TypeError(
            f"{what}{type(value).__name__} {_short(repr(value))} (expected a float or a "
            f"dict of floats: {SIGNATURE})"
        )
    try:
        x = float(value)
    except OverflowError:  # an int (or a fraction) beyond any float
        x = math.inf if value > 0 else -math.inf
    if math.isnan(x):
        raise ValueError(f"{what}{x} (rewards must be finite)")
    if abs(x) > MAX_REWARD:
        shown = _short(repr(value)) if math.isinf(x) else f"{x:g}"
        raise ValueError(
            f"{what}{shown} (rewards must be finite, within +-{MAX_REWARD:g}: scale it down)"
        )
    return x


def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
