"""Device and dtype names as the configs and the CLI spell them, resolved once.

`device`: 'auto' (the first CUDA device when torch sees one, else the CPU), 'cpu',
'cuda' or 'cuda:N'. `dtype`: 'float32' or 'bfloat16'. The rollout side and the learner
side each have their own pair (`rollout.device/dtype`, `learner.device/dtype`): on one
GPU both are 'auto'; with Ray each worker resolves 'auto' to the GPU it was given.

Names are checked without touching CUDA (config validation must work on any machine);
`resolve_device` is where a CUDA name meets the hardware, and fails naming the field.
"""

from __future__ import annotations

import re

import torch

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
"""The device names a config accepts (N: a CUDA device index)."""
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtype names a config accepts, and what they mean."""

_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device_name(where: str, name: str) -> None:
    """ValueError naming `where` unless `name` is one of DEVICES."""
    if not isinstance(name, str) or not _DEVICE_RE.match(name):
        raise ValueError(f"{where} must be one of {', '.join(DEVICES)}; got {name!r}")


def check_dtype_name(where: str, name: str) -> None:
    """ValueError naming `where` unless `name` is one of DTYPES."""
    if name not in DTYPES:
        raise ValueError(f"{where} must be one of {', '.join(DTYPES)}; got {name!r}")


def resolve_device(name: str, where: str = "device") -> torch.device:
    """The torch.device a name means on this machine ('auto': CUDA when present)."""
    check_device_name(where, name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{where}={name!r}, but this torch sees no CUDA device "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
                "use 'auto' or 'cpu'"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"{where}={name!r}: this machine has {torch.cuda.device_count()} CUDA "
                f"device(s), cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(name: str, where: str = "dtype") -> torch.dtype:
    """The torch.dtype a name means."""
    check_dtype_name(where, name)
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The config name of a torch dtype (inverse of `resolve_dtype`)."""
    for k, v in DTYPES.items():
        if v == dtype:
            return k
    raise ValueError(f"dtype {dtype} has no config name; names: {', '.join(DTYPES)}")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (timings on a GPU measure nothing without it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


HOST_PACED = ("cpu",)
"""Device types whose tree walk is paced by the host (`engine.tree_step`): reading back
costs nothing there, so the LM head runs over the accepted path only, and a drafter may
read its candidates back to build its tree on the host (`drafters.combined`)."""


def host_paced(device: torch.device | str) -> bool:
    """Whether `device` is one whose work the host may pace by reading back (`HOST_PACED`)."""
    return torch.device(device).type in HOST_PACED


def copy_in(dst: torch.Tensor, values: torch.Tensor) -> None:
    """Host values (a CPU tensor) into the device tensor `dst`, in place and without a
    sync: from pinned memory, non-blocking (`upload`)."""
    if dst.device.type == "cpu":
        dst.copy_(values)
    else:
        dst.copy_(values.pin_memory(), non_blocking=True)


def upload(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values (a list, or a CPU tensor) as a tensor on `device`, without a sync.

    A plain copy from pageable memory to a GPU waits for the stream (PyTorch synchronises
    after it), which would stall the engine's iteration as a read-back does; a copy from
    pinned memory with `non_blocking` is queued like a kernel. (PyTorch's pinned-memory
    allocator keeps the buffer until the copy has run.)"""
    t = (
        values
        if isinstance(values, torch.Tensor)
        else torch.tensor(values, dtype=dtype, device="cpu")
    )
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
