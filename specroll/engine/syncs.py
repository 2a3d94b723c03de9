"""Counting host synchronisations: the calls that would stall a GPU stream.

On a GPU every `int()`, `bool()`, `float()`, `.item()`, `.tolist()` of a device tensor,
every `nonzero()` and every boolean-mask index waits for all queued kernels: the host
learns a value (or a result's size) it needs before it can launch the next kernel. A
decode iteration that does this ten times runs ten short queues instead of one long one.

`HostSyncs` counts them by intercepting the tensor calls that force one (a
`TorchFunctionMode`), so the count is the same on the CPU, where it costs nothing, as on
a GPU, where it costs a stall each: CI counts them, and a test pins the engine's per
iteration. Only tensors on `device` count (by default: all), so that host-side metadata a
GPU run keeps on the CPU on purpose is not mistaken for a sync.

    with HostSyncs() as syncs:
        engine.generate(requests)
    syncs.total, syncs.by_call   # e.g. 212, {'tolist': 40, '__int__': 120, ...}
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

SYNC_CALLS = frozenset(
    {
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "item",
        "tolist",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "cpu",
        "numpy",
        "equal",
        "allclose",
        "is_nonzero",
    }
)
"""Calls that read a device tensor's values (or a data-dependent size) on the host."""
_INDEXING = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})
"""Calls that sync only when an index is a boolean mask (its True count sets a size)."""


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def _caller() -> str:
    """file:line of the innermost specroll frame below this module (where a sync is made)."""
    import sys

    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "specroll" in name and not name.endswith("syncs.py"):
            return f"{name.split('specroll/', 1)[-1]}:{f.f_lineno}"
        f = f.f_back
    return "?"


class HostSyncs(TorchFunctionMode):
    """Counts host synchronisations on `device` tensors while active (see module doc)."""

    def __init__(self, device: torch.device | str | None = None, sites: bool = False) -> None:
        super().__init__()
        self.device = None if device is None else torch.device(device)
        self.by_call: Counter[str] = Counter()
        self.sites: Counter[str] | None = Counter() if sites else None
        """With `sites`: syncs by the specroll source line that made them (file:line)."""

    @property
    def total(self) -> int:
        return sum(self.by_call.values())

    def _on_device(self, args) -> bool:
        if self.device is None:
            return True
        return any(t.device.type == self.device.type for t in _tensors(args))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "to" and self._moves_to_host(args, kwargs or {}):
            name = "cpu"
        syncs = name in SYNC_CALLS
        if name in _INDEXING and len(args) > 1:
            idx = args[1]
            syncs = any(t.dtype == torch.bool for t in _tensors(idx))
        if syncs and self._on_device(args[:1]):
            self.by_call[name] += 1
            if self.sites is not None:
                self.sites[_caller()] += 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _moves_to_host(args, kwargs) -> bool:
        dest = kwargs.get("device", args[1] if len(args) > 1 else None)
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is None or src.device.type == "cpu" or isinstance(dest, torch.dtype):
            return False
        return dest is not None and torch.device(dest).type == "cpu"
