"""Device and dtype names as the configs and the CLI spell them, resolved once.

`device`: 'auto' (the first CUDA device when torch sees one, else the CPU), 'cpu',
'cuda' or 'cuda:N'. `dtype`: 'float32' or 'bfloat16'. The rollout side and the learner
side each have their own pair (`rollout.device/dtype`, `learner.device/dtype`): on one
GPU both are 'auto'; with Ray each worker resolves 'auto' to the GPU it was given.

Names are checked without touching CUDA (config validation must work on any machine);
`resolve_device` is where a CUDA name meets the hardware, and fails naming the field.
`bf16_speedup` measures whether bf16 products pay on a device (`learner.dtype: auto`).
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import time
from pathlib import Path

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


def check_dtype_name(where: str, name: str, extra: tuple[str, ...] = ()) -> None:
    """ValueError naming `where` unless `name` is one of DTYPES (`extra`: other names
    the field accepts, listed in the message)."""
    if name not in DTYPES:
        raise ValueError(f"{where} must be one of {', '.join((*DTYPES, *extra))}; got {name!r}")


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


# ---------------------------------------------------------------- measured capability
# bf16 pays only where the hardware multiplies bf16 natively: CPUs with AVX-512 BF16 or
# AMX (about 2x an fp32 product), GPUs from Ampere on. Elsewhere (an AVX2-only CPU)
# PyTorch emulates it and bf16 runs *slower* than fp32. So `learner.dtype: auto` times
# the learner's own kind of product (an autocast linear over fp32 master weights, the
# cast included) in both dtypes on the learner's device, and picks bf16 only when it is
# clearly faster (`BF16_MARGIN`: noise cannot flip a 2x machine or a 0.5x one).

BF16_MARGIN = 1.3
"""bf16 is chosen when its products measure at least this many times fp32's speed."""
SHAPE = (1024, 576, 1536)
"""(rows, in, out) of the timed product: a learner micro-batch's MLP product at SmolLM2's
width (the learner multiplies thousands of rows by every weight)."""


def _machine(device: torch.device) -> str:
    """A name for the hardware and the torch that drives it (the cache key)."""
    if device.type == "cuda":
        hw = torch.cuda.get_device_name(device)
    else:
        hw = _cpu_model() + f"-t{torch.get_num_threads()}"
    return f"{device.type}-{hw}-torch{torch.__version__}".replace(" ", "_").replace("/", "_")


def _cpu_model() -> str:
    """The CPU's model name and whether it flags native bf16 (from /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "cpu"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if "model name" in ln), "")
    flags = ("avx512_bf16" in text) * "-avx512bf16" + ("amx_bf16" in text) * "-amx"
    return (name or "cpu") + flags


def _time_product(device: torch.device, bf16: bool, repeats: int) -> float:
    """Median seconds of the learner's product (autocast linear over fp32 weights)."""
    g = torch.Generator().manual_seed(0)
    M, K, N = SHAPE
    x = torch.randn(M, K, generator=g).to(device)
    w = torch.randn(N, K, generator=g).to(device)
    times = []
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for _ in range(repeats + 1):  # the first is a warm-up
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(4):
                torch.nn.functional.linear(x, w)
            synchronize(device)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def bf16_speedup(device: torch.device, path: Path | None = None, repeats: int = 5) -> float:
    """fp32 product time over bf16 product time on `device`, measured once per machine
    and kept in the JSON file `path` (None: measured every time)."""
    key = _machine(device)
    known = _read_json(path)
    value = known.get(key)
    if isinstance(value, (int, float)) and 0 < value < 1e3:
        return float(value)
    fp32, bf16 = [], []
    for _ in range(2):  # interleaved: both dtypes see the same machine load
        fp32.append(_time_product(device, False, repeats))
        bf16.append(_time_product(device, True, repeats))
    speedup = min(fp32) / min(bf16)
    known[key] = round(speedup, 3)
    if path is None:
        return speedup
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(known, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measured again next time
    return speedup


def _read_json(path: Path | None) -> dict:
    """The measurements kept in `path` ({} when there are none or they are unreadable)."""
    try:
        known = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def learner_dtype(device: torch.device, path: Path | None = None) -> tuple[str, str]:
    """(dtype name, why) that `learner.dtype: auto` means on `device` (`path`: where the
    measurement is kept, see `bf16_speedup`)."""
    s = bf16_speedup(device, path)
    if s >= BF16_MARGIN:
        return "bfloat16", f"bf16 products measured {s:.2f}x fp32's speed here"
    return "float32", f"bf16 products measured {s:.2f}x fp32's speed here (< {BF16_MARGIN}x)"
