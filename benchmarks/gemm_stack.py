"""How cheap can verifying q tokens per row be on this CPU? The GEMM stack, measured.

`specroll bench engine` reports verify_cost = time(forward adding q tokens per row) /
time(adding 1). At batch 4, q = 4 the forward multiplies M = 16 rows by every weight, and
the GEMMs are most of the forward. This script times exactly that part in isolation: the
121 matrix products of one SmolLM2-135M forward (30 layers x qkv / o / gate-up / down,
plus the LM head) with *distinct* weights, so they stream from DRAM as in the engine,
for M = 1, 4, 16 rows and each available kernel:

  * onednn  - oneDNN-prepacked weights (`_linear_pointwise`), the engine's path off Intel;
  * mkl     - MKL-packed weights (`_mkl_linear`), the engine's path on Intel CPUs;
  * mm      - plain `x @ w` (MKL / OpenBLAS sgemm);
  * inductor (with --inductor) - torch.compile max-autotune with freezing, which may pick
    its own C++ GEMM template (AVX-512 micro-kernels) per shape when faster.

It also measures one hot (cache-resident) product at M = 16 for the compute roof, and
reports what a ratio of 1.3 at M = 16 vs M = 4 would require: the M = 16 FLOPs done in
1.3x the time the engine's kernel (oneDNN) takes for the M = 4 stack.

Prints a table and one JSON line. Run:

    python benchmarks/gemm_stack.py [--repeats 15] [--inductor]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from specroll.engine.bench import median_time
from specroll.model import packed as packing
from specroll.sim.catalogue import model_spec

ROWS = (1, 4, 16, 32, 64)


def _median_ms(fn, repeats: int) -> float:
    """Median wall time of fn() in ms, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    return median_time(repeats, fn) * 1e3


def stack_shapes() -> list[tuple[int, int]]:
    """(K, N) of every product in one SmolLM2-135M forward, in order."""
    s = model_spec("smollm2-135m")
    H, q, kv, inter = s.hidden, s.q_heads * s.head_dim, s.kv_heads * s.head_dim, s.ffn
    layer = [(H, q + 2 * kv), (q, H), (H, 2 * inter), (inter, H)]
    return layer * s.layers + [(H, s.vocab)]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--inductor", action="store_true", help="also torch.compile max-autotune")
    return ap.parse_args()


def inductor_kernel(shapes, ws: list[torch.Tensor], xs: dict) -> Callable[[int], object]:
    """The stack as `nn.Linear`s compiled with max-autotune and freezing, one graph per M."""
    import torch._inductor.config as ic

    ic.freezing, ic.max_autotune = True, True
    ic.max_autotune_gemm_backends = "CPP,ATEN"
    linears = torch.nn.ModuleList()
    for w in ws:
        lin = torch.nn.Linear(w.shape[0], w.shape[1], bias=False)
        lin.weight.data = w.T.contiguous()
        linears.append(lin)
    linears.eval()

    def run_all(x_by_k: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [lin(x_by_k[K]) for (K, _), lin in zip(shapes, linears, strict=True)]

    compiled = {}
    with torch.no_grad():
        for M in ROWS:
            compiled[M] = torch.compile(run_all, dynamic=False)
            compiled[M](xs[M])
    return lambda M: compiled[M](xs[M])


def stack_kernels(
    shapes, ws: list[torch.Tensor], packed: list[torch.Tensor], xs: dict, inductor: bool
) -> dict[str, Callable[[int], object]]:
    """Every available kernel as fn(M): the whole stack of products on M rows."""
    kernels = {
        "onednn": lambda M: [
            torch.ops.mkldnn._linear_pointwise(xs[M][K], p, None, "none", [], "")
            for (K, _), p in zip(shapes, packed, strict=True)
        ],
        "mm": lambda M: [xs[M][K] @ w for (K, _), w in zip(shapes, ws, strict=True)],
    }
    if packing.mkl_available():
        mkl = [packing.pack(w, "mkl") for w in ws]
        kernels["mkl"] = lambda M: [
            packing.packed_mm(xs[M][K], w, p) for (K, _), w, p in zip(shapes, ws, mkl, strict=True)
        ]
    if inductor:
        kernels["inductor"] = inductor_kernel(shapes, ws, xs)
    return kernels


def stack_ms(kernels: dict, repeats: int) -> dict[str, dict[int, float]]:
    """Best over 3 rounds of each kernel's median stack time (ms) per M."""
    ms: dict[str, dict[int, float]] = {k: {} for k in kernels}
    for _ in range(3):  # rounds: every kernel and M sees the same machine load
        for name, fn in kernels.items():
            for M in ROWS:
                t = _median_ms(lambda fn=fn, M=M: fn(M), max(repeats // 3, 3))
                ms[name][M] = min(ms[name].get(M, float("inf")), t)
    return ms


def hot_gflop_s(shapes, packed: list[torch.Tensor], g: torch.Generator, repeats: int) -> float:
    """Compute roof: one cache-resident gate/up product at M = 16, in GFLOP/s."""
    K, N = shapes[2]
    x16 = torch.randn(16, K, generator=g)
    hot = _median_ms(
        lambda: [
            torch.ops.mkldnn._linear_pointwise(x16, packed[2], None, "none", [], "")
            for _ in range(50)
        ],
        repeats,
    )
    return 2 * 16 * K * N * 50 / hot / 1e6


def table(ms: dict[str, dict[int, float]], weight_bytes: int, flops_per_row: int) -> list[dict]:
    """Print and return one row per kernel and M."""
    rows = []
    print(f"{'kernel':>9} {'M':>3} {'ms':>7} {'GB/s':>6} {'GFLOP/s':>8} {'vs M=4':>7}")
    for name, by_m in ms.items():
        for M in ROWS:
            row = {
                "kernel": name,
                "rows": M,
                "ms": round(by_m[M], 3),
                "gb_s": round(weight_bytes / by_m[M] / 1e6, 1),
                "gflop_s": round(flops_per_row * M / by_m[M] / 1e6, 1),
                "ratio_vs_m4": round(by_m[M] / by_m[4], 3),
            }
            rows.append(row)
            print(
                f"{name:>9} {M:>3} {row['ms']:>7.2f} {row['gb_s']:>6.1f} "
                f"{row['gflop_s']:>8.1f} {row['ratio_vs_m4']:>7.3f}"
            )
    return rows


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    shapes = stack_shapes()
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(K, N, generator=g) * K**-0.5 for K, N in shapes]  # [K, N] each
    packed = [torch.ops.mkldnn._reorder_linear_weight(w.T.contiguous()) for w in ws]
    weight_bytes = sum(w.numel() for w in ws) * 4
    flops_per_row = 2 * sum(w.numel() for w in ws)
    xs = {M: {K: torch.randn(M, K, generator=g) for K in {k for k, _ in shapes}} for M in ROWS}
    kernels = stack_kernels(shapes, ws, packed, xs, args.inductor)

    with torch.no_grad():
        ms = stack_ms(kernels, args.repeats)
        hot_gflops = hot_gflop_s(shapes, packed, g, args.repeats)

    rows = table(ms, weight_bytes, flops_per_row)
    # verify_cost compares the engine's kernel with itself: oneDNN at M = 16 vs M = 4
    need = flops_per_row * 16 / (1.3 * ms["onednn"][4]) / 1e6
    print(
        f"hot oneDNN M=16 product: {hot_gflops:.0f} GFLOP/s. A 1.3 ratio of oneDNN at M=16 "
        f"to its M=4 needs {need:.0f} GFLOP/s sustained while streaming "
        f"{weight_bytes / 1e6:.0f} MB."
    )
    out = {
        "bench": "gemm_stack",
        "threads": args.threads,
        "weight_mb": round(weight_bytes / 1e6, 1),
        "rows": rows,
        "hot_gflop_s_m16": round(hot_gflops, 1),
        "needed_gflop_s_for_1_3": round(need, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
