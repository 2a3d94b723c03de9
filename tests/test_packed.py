"""The packed CPU GEMMs compute what `x @ w` computes, for every row count the engine uses."""

import pytest
import torch

from specroll.model import packed
from specroll.model.packed import GEMMS, PackedWeights, cpu_gemm, packed_mm, set_cpu_gemm


def _available(name: str) -> bool:
    return packed.mkl_available() if name == "mkl" else packed.onednn_available()


@pytest.fixture
def restore_gemm():
    yield
    set_cpu_gemm(None)


@pytest.mark.parametrize("name", GEMMS)
def test_one_packed_copy_serves_every_row_count(name, restore_gemm):
    if not _available(name):
        pytest.skip(f"{name} is not in this torch build")
    set_cpu_gemm(name)
    assert cpu_gemm() == name
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, 960, generator=g) * 576**-0.5  # [in, out], SmolLM2's qkv shape
    p = packed.pack(w, name)
    for rows in (1, 2, 3, 4, 5, 16, 31, 32, 64, 65, 128, 300):
        x = torch.randn(rows, 576, generator=g)
        want = x.double() @ w.double()
        got = packed_mm(x, w, p)
        assert got.shape == (rows, 960)
        assert (got.double() - want).abs().max().item() < 1e-4, rows
    x3 = torch.randn(2, 3, 576, generator=g)  # [B, T, H] as the model calls it
    assert torch.allclose(packed_mm(x3, w, p), x3 @ w, atol=1e-4)


def test_a_kernel_change_repacks(restore_gemm):
    if not all(_available(n) for n in GEMMS):
        pytest.skip("needs both MKL and oneDNN")
    w = torch.randn(64, 32)
    pw = PackedWeights()
    with torch.no_grad():
        set_cpu_gemm("mkl")
        assert isinstance(pw.get([w], lambda p: p[0]), packed.MklPacked)
        set_cpu_gemm("onednn")
        assert not isinstance(pw.get([w], lambda p: p[0]), packed.MklPacked)
    assert pw.get([w], lambda p: p[0]) is None  # autograd recording: never packed


def test_bad_kernel_names_are_refused(monkeypatch, restore_gemm):
    with pytest.raises(ValueError, match="one of"):
        set_cpu_gemm("openblas")
    monkeypatch.setenv("SPECROLL_CPU_GEMM", "blis")
    with pytest.raises(ValueError, match="SPECROLL_CPU_GEMM must be one of auto, mkl, onednn"):
        cpu_gemm()
