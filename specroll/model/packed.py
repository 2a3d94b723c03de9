"""Prepacked weights for grad-free CPU products: the GEMM path of the engine and drafters.

A decode step multiplies a few rows (the batch, or batch x (k+1) when verifying) by every
weight, streamed from memory. Packing a weight once into the kernel's own layout makes
such a product about as cheap as the hardware allows; both packings here come from the
libraries PyTorch ships, chosen once per process:

* `mkl`: MKL's packed sgemm (`mkl._mkl_linear`), fp32: the faster of the two on Intel
  CPUs (`python benchmarks/gemm_stack.py` compares them on the machine at hand).
* `onednn`: oneDNN's packed inner product (`mkldnn._linear_pointwise`), fp32 and bf16
  (bf16 where the CPU has native bf16). The default elsewhere (MKL is tuned for Intel).

The choice is made from the CPU vendor, not by timing, so one machine always computes
the same rounding (seeded generations are reproducible across processes);
`SPECROLL_CPU_GEMM=mkl|onednn` overrides it. bf16 weights always use oneDNN.

MKL's packed right-hand matrix does not depend on the row count of the product, but
`_mkl_linear` only uses it when the rows equal the `prepack_batch_size` it is given (else
it silently runs an unpacked product). Each call passes its own row count, and the first
use in a process checks on a small matrix that a buffer packed once computes every row
count as `x @ w` does (to fp32 rounding); if it does not, oneDNN is used instead.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

GEMMS = ("mkl", "onednn")
"""The packed-GEMM kernels a CPU forward may use."""

_ENV = "SPECROLL_CPU_GEMM"
_PACK_ROWS = 64
"""Row count MKL packs for. The buffer serves every row count with the same results (bit
for bit from 4 rows on), but its layout is tuned for this one: 64 covers the engine's
decode and verification products without slowing larger ones much."""
_choice: str | None = None  # set_cpu_gemm's override of the automatic choice


class MklPacked(NamedTuple):
    """An MKL-packed weight and the `[out, in]` view of the original it was packed from
    (`_mkl_linear` reads the product's shape and dtype from it)."""

    buffer: torch.Tensor
    weight_t: torch.Tensor


def mkl_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


@functools.cache
def _cpu_vendor() -> str:
    """The `vendor_id` of /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), or "" (read once:
    `cpu_gemm` runs on every packed forward)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _mkl_pack(w: torch.Tensor) -> MklPacked:
    wt = w.detach().T  # [out, in] view of the [in, out] weight
    # the buffer serves every row count; the one given tunes its layout (see _PACK_ROWS)
    return MklPacked(torch.ops.mkl._mkl_reorder_linear_weight(wt.contiguous(), _PACK_ROWS), wt)


def _mkl_mm(x: torch.Tensor, p: MklPacked) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(x, p.buffer, p.weight_t, None, x.numel() // x.shape[-1])


@functools.cache
def _mkl_packing_works() -> bool:
    """One packed buffer computes products of any row count like `x @ w` (see module)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=g)  # [in, out]
    p = _mkl_pack(w)
    for rows in (1, 3, 17, 64):
        x = torch.randn(rows, 96, generator=g)
        if not torch.allclose(_mkl_mm(x, p), x @ w, rtol=1e-5, atol=1e-5):
            return False
    return True


def set_cpu_gemm(name: str | None) -> None:
    """Use kernel `name` (one of GEMMS) for fp32 packing from now on; None restores the
    automatic choice. Packed copies made before are rebuilt on their next use."""
    if name is not None and name not in GEMMS:
        raise ValueError(f"cpu gemm must be one of {GEMMS} or None, got {name!r}")
    global _choice
    _choice = name


def cpu_gemm() -> str | None:
    """The kernel fp32 CPU weights are packed for: set_cpu_gemm's, else $SPECROLL_CPU_GEMM,
    else MKL on Intel CPUs and oneDNN elsewhere; None when neither is available."""
    name = _choice or os.environ.get(_ENV, "auto")
    if name not in ("auto", *GEMMS):
        raise ValueError(f"{_ENV} must be one of auto, {', '.join(GEMMS)}; got {name!r}")
    if name == "mkl" or (name == "auto" and _cpu_vendor() == "GenuineIntel"):
        if mkl_available() and _mkl_packing_works():
            return "mkl"
        if name == "mkl":
            warnings.warn(
                f"{_ENV}=mkl: MKL's packed GEMM is unavailable or failed its check; using oneDNN",
                RuntimeWarning,
                stacklevel=2,
            )
    return "onednn" if onednn_available() else None


def _bf16_native() -> bool:
    """oneDNN has native bf16 kernels on this CPU (AVX-512 BF16 / AMX)."""
    is_supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(is_supported is not None and is_supported())


def packing(w: torch.Tensor) -> str | None:
    """The kernel weight `w` is packed for: `cpu_gemm()` for an fp32 CPU tensor, oneDNN
    for bf16 where the CPU has native bf16 (there the packed bf16 product beats a plain
    bf16 matmul at 1-4 rows, the verification sizes), else None (no packing)."""
    if w.device.type != "cpu":
        return None
    if w.dtype == torch.float32:
        return cpu_gemm()
    if w.dtype == torch.bfloat16 and onednn_available() and _bf16_native():
        return "onednn"
    return None


def pack(w: torch.Tensor, kernel: str) -> MklPacked | torch.Tensor:
    """A packed copy of an `[in, out]` weight for `kernel` (opaque layout, grad-free use)."""
    if kernel == "mkl":
        return _mkl_pack(w)
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().T.contiguous())


def packed_mm(
    x: torch.Tensor, w: torch.Tensor, packed: MklPacked | torch.Tensor | None
) -> torch.Tensor:
    """x @ w ([..., in] @ [in, out]), through the packed copy when one is given."""
    if packed is None:
        return x @ w
    if isinstance(packed, MklPacked):
        return _mkl_mm(x, packed)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class PackedWeights:
    """Packed copies of a module's weights, rebuilt whenever any weight changes.

    Staleness is detected from each tensor's (data_ptr, version counter): an optimizer
    step (in place) or a weight load (new tensors) both invalidate the copies, so an
    engine never generates with weights older than the module's. A change of kernel
    (`set_cpu_gemm`) invalidates them too.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: Any = None

    def __deepcopy__(self, memo: dict) -> PackedWeights:
        return PackedWeights()  # opaque packed tensors cannot be copied; a copy repacks

    def get(self, weights: list[torch.Tensor], arrange: Callable[[list[Any]], Any]):
        """arrange(packed copies of `weights`, same order), or None when packing does not
        apply: autograd recording, or no packed kernel for the first weight."""
        kernel = None if torch.is_grad_enabled() else packing(weights[0])
        if kernel is None:
            return None
        key = (kernel, *((w.data_ptr(), w._version) for w in weights))
        if key != self._key:
            self._value = None  # release the stale copies before building new ones
            self._value = arrange([pack(w, kernel) for w in weights])
            self._key = key
        return self._value
