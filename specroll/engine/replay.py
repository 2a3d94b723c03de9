"""Capture and replay of a step on the CPU, as a CUDA graph captures and replays it.

A CUDA graph records the kernels a function launches, with their arguments — the
addresses of the tensors they read and write and every host value passed to them — and
its replay launches those kernels again without running any Python. A host value the
function computed while it was captured (a batch size, a position, a seed as a Python
int) is frozen into the graph: replays reuse it, whatever the host holds by then.

`record(fn)` does the same with PyTorch's dispatcher on any device: it runs fn once,
records every ATen operation it dispatches with its arguments (tensors by identity,
everything else by value) and returns a `Replay` that runs the recorded operations
again, in order, without fn's Python. A tensor that existed before the capture (the
engine's slots, cache, buffers and weights) is the same tensor at every replay, read and
written in place as a graph reads and writes its addresses; a tensor fn made is made
anew by its operation. So a step that is correct on a GPU replays correctly here, and a
step that bakes in a host value replays that stale value here too: a test on this CPU
holds the step to what a GPU would run (`engine.graphs` uses this off CUDA).

A read of the device inside fn (`.item()`, `.tolist()`, `bool(t)`, data-dependent
shapes such as `nonzero`) is an error, as it is inside a CUDA graph capture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten

HOST_READS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
}
"""Operations whose result the host must read (a sync inside a CUDA graph capture)."""
HOST_METHODS = {"tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__"}
"""Tensor methods that hand a value to the host (`.tolist()` reads memory directly,
below the dispatcher, so it is caught where it is called)."""


class CaptureError(RuntimeError):
    """The captured function read a device value back on the host."""


# how a recorded argument is found at replay: (op index, output index) for a value fn
# made; a tensor from outside or any other value is kept as it was
_Made = tuple[int, int]
_FLAT = (list, tuple, dict)


@contextmanager
def _no_host_reads() -> Iterator[None]:
    """Tensor methods that hand a value to the host raise while fn is captured (patched
    on the class for the capture's duration: a function mode would tax every call)."""

    def refuse(name: str):
        def method(*args, **kwargs):
            raise CaptureError(f"Tensor.{name}() reads the device back inside a captured step")

        return method

    saved = {name: getattr(torch.Tensor, name) for name in HOST_METHODS}
    try:
        for name in HOST_METHODS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


class _Recorder(TorchDispatchMode):
    """Runs each operation and records it (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        # (op, args, kwargs, spec): args and kwargs with made values as `_Made`; spec is
        # None when both are flat, else the pytree spec of their leaves (args)
        self.ops: list[tuple[Any, list, dict, Any]] = []
        self.made: dict[int, _Made] = {}  # id(tensor) -> where a replay finds it
        self.alive: list[torch.Tensor] = []  # every tensor seen: no id is reused meanwhile

    def ref(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        self.alive.append(x)
        return self.made.get(id(x), x)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise CaptureError(f"{func} reads the device back inside a captured step")
        out = func(*args, **kwargs)
        i, ref = len(self.ops), self.ref
        if any(isinstance(a, _FLAT) for a in args) or any(
            isinstance(a, _FLAT) for a in kwargs.values()
        ):
            flat, spec = tree_flatten((args, kwargs))
            self.ops.append((func, [ref(x) for x in flat], {}, spec))
        else:
            kw = {k: ref(v) for k, v in kwargs.items()} if kwargs else kwargs
            self.ops.append((func, [ref(x) for x in args], kw, None))
        if isinstance(out, torch.Tensor):
            self.alive.append(out)
            self.made[id(out)] = (i, 0)
            return out
        for j, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor):
                self.alive.append(t)
                self.made[id(t)] = (i, j)
        return out


class Replay:
    """The recorded operations of one capture; calling it replays them (module
    docstring) and returns the captured function's outputs, refilled in place (the same
    tensors every replay, as a CUDA graph's outputs are)."""

    def __init__(self, rec: _Recorder, out: Any) -> None:
        self.ops = rec.ops
        flat, self._spec = tree_flatten(out)
        self.outputs = flat
        self._out_refs = [rec.ref(x) for x in flat]
        # each made value is dropped after its last use, as a graph's pool reuses memory
        last: dict[_Made, int] = {}
        for i, (_, args, kwargs, _) in enumerate(self.ops):
            for r in (*args, *kwargs.values()):
                if type(r) is tuple:
                    last[r] = i
        keep = {r for r in self._out_refs if type(r) is tuple}
        self._drop: list[list[_Made]] = [[] for _ in self.ops]
        for r, i in last.items():
            if r not in keep:
                self._drop[i].append(r)

    def outputs_tree(self) -> Any:
        """The captured function's outputs (as the capture's run left them)."""
        return tree_unflatten(self.outputs, self._spec)

    def __call__(self) -> Any:
        vals: dict[_Made, torch.Tensor] = {}
        for i, (func, args, kwargs, spec) in enumerate(self.ops):
            a = [vals[r] if type(r) is tuple else r for r in args]
            if spec is not None:
                a, kw = tree_unflatten(a, spec)
            else:
                kw = {k: vals[r] if type(r) is tuple else r for k, r in kwargs.items()}
            out = func(*a, **kw)
            if isinstance(out, torch.Tensor):
                vals[(i, 0)] = out
            else:
                for j, t in enumerate(tree_flatten(out)[0]):
                    if isinstance(t, torch.Tensor):
                        vals[(i, j)] = t
            for r in self._drop[i]:
                vals.pop(r, None)
        for static, r in zip(self.outputs, self._out_refs, strict=True):
            if isinstance(static, torch.Tensor) and type(r) is tuple:
                static.copy_(vals[r])
        return self.outputs_tree()


def record(fn: Callable[[], Any]) -> Replay:
    """Run fn() once, recording it; → its `Replay` (module docstring). fn's own result
    of this run is what the replay refills; raises `CaptureError` on a host read."""
    rec = _Recorder()
    with _no_host_reads(), rec:
        out = fn()
    return Replay(rec, out)
