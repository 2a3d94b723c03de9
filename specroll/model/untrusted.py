"""Pickled files that may come from elsewhere, read as data and never as code.

A pickle is a program: unpickling calls whatever importable callable it names, so a
checkpoint, a sharded checkpoint's metadata or a draft trainer's state from someone else
could run anything on this machine if it were unpickled plainly. specroll reads its own
pickled files (the ones safetensors + JSON cannot hold: optimizer states, RNG states,
`torch.distributed.checkpoint` metadata) through the two readers here only:

* `load_tensors`: `torch.load(weights_only=True)`, torch's own restricted unpickler
  (tensors, numbers, strings, containers);
* `load_restricted`: a plain pickle whose every global must pass an allowlist the caller
  gives (DCP's metadata classes, see `rl.learner.fsdp.dcp_read`).

A refusal is one `UnreadableFile` line naming the file and what it asked for, never
torch's advice to retry with `weights_only=False` (that retry is the attack).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specroll.inputs import UnreadableFile, regular

__all__ = ["UnreadableFile", "explain", "load_restricted", "load_tensors", "refusal"]

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
"""How torch's weights-only unpickler names the global it refused."""


def refusal(path: str | Path, what: str, asked: str | None) -> UnreadableFile:
    """The refusal of `path` (a `what`: 'checkpoint', ...) that asks to run code."""
    why = f"it asks to import {asked}" if asked else "it holds objects other than plain data"
    return UnreadableFile(
        f"{path}: not a {what} this specroll can read safely ({why}); files from "
        "elsewhere are read as tensors and plain data only, never run"
    )


def unreadable(path: str | Path, what: str, error: BaseException) -> UnreadableFile:
    """`path` could not be read as a `what` (truncated, corrupt, another format)."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return UnreadableFile(f"{path}: not a readable {what} ({reason})")


def explain(error: BaseException, path: str | Path, what: str) -> UnreadableFile:
    """The one line for `error`, met reading `path` (a `what`) with torch's weights-only
    unpickler: a refusal naming the global it asked for, or why it is unreadable."""
    if isinstance(error, pickle.UnpicklingError):
        found = _GLOBAL.search(str(error))
        return refusal(path, what, found.group(1) if found else None)
    if isinstance(error, FileNotFoundError):
        return UnreadableFile(f"{path}: missing")
    return unreadable(path, what, error)


def load_tensors(path: str | Path, what: str = "checkpoint", mmap: bool = False) -> Any:
    """`torch.load(path, weights_only=True)`: tensors, numbers, strings and containers.
    A file that holds anything else is refused, naming the global it asked for."""
    regular(path, what)
    try:
        return torch.load(path, weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as e:
        raise explain(e, path, what) from None


class _Restricted(pickle.Unpickler):
    """An unpickler that imports only the globals `allowed(module, name)` admits."""

    def __init__(self, file, path: Path, what: str, allowed: Callable[[str, str], bool]):
        super().__init__(file)
        self._path, self._what, self._allowed = path, what, allowed

    def find_class(self, module: str, name: str) -> Any:
        if not self._allowed(module, name):
            raise refusal(self._path, self._what, f"{module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise refusal(self._path, self._what, "a persistent object")


def load_restricted(
    path: str | Path, allowed: Callable[[str, str], bool], what: str = "checkpoint"
) -> Any:
    """Unpickle `path`, importing only the globals `allowed(module, name)` admits; the
    caller checks the type of what comes back. Any failure is one `UnreadableFile` line."""
    path = Path(path)
    regular(path, what)
    try:
        with open(path, "rb") as f:
            return _Restricted(f, path, what, allowed).load()
    except UnreadableFile:
        raise
    except FileNotFoundError:
        raise UnreadableFile(f"{path}: missing") from None
    except Exception as e:  # noqa: BLE001 - a forged pickle fails anywhere: say so in one line
        raise unreadable(path, what, e) from None
