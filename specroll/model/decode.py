"""The engine's decoder layers as one TorchScript function: a CPU decode step without Python.

A decode step of a small model on a CPU is mostly fixed costs: each layer runs some 25
small ATen calls, and the Python around each call (binding, argument parsing, the module
code) weighs about as much as the kernels themselves. Running the layer loop as one
scripted function keeps the same ATen calls, in the same order on the same tensors — it
calls `specroll.model.ops`' own `rms_norm`, `apply_rotary` and `attention`, and repeats
only `transformer.Block.forward`'s sequence of them — so the result is the eager
forward's bit for bit (a test checks it, for both packed kernels;
`benchmarks/decode_forward.py` times the two).

It serves the grad-free fp32 CPU forward with a KV cache and packed weights (the engine's
prefill, decode and verification), for layers without a qkv bias or q/k norms (Llama,
SmolLM2). Anything else — autograd, bf16, GPUs, Qwen2 / Qwen3 layers — runs the eager
loop, as does every forward if TorchScript is unavailable (`torch.jit.script` is
deprecated in PyTorch 2.x; torch.compile cannot lower the prepacked products without
freezing the weights, see `benchmarks/gemm_stack.py --inductor`).
"""

from __future__ import annotations

import functools
import warnings
from typing import List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from specroll.model import ops
from specroll.model.kv_cache import KVCache
from specroll.model.packed import MklPacked

_enabled = True


def set_scripted(enabled: bool) -> None:
    """Run the scripted layers where they apply (default) or always the eager loop."""
    global _enabled
    _enabled = enabled


def _product(x: torch.Tensor, w: torch.Tensor, original: Optional[torch.Tensor], rows: int):
    """`packed.packed_mm` on a oneDNN-packed weight, or on an MKL buffer and its original."""
    if original is not None:
        return torch.ops.mkl._mkl_linear(x, w, original, None, rows)
    none: List[Optional[Union[int, float, complex]]] = []
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", none, "")


def _layers(
    x: torch.Tensor,
    attn_norm: List[torch.Tensor],
    mlp_norm: List[torch.Tensor],
    weights: List[List[torch.Tensor]],
    originals: List[List[Optional[torch.Tensor]]],
    keys: List[torch.Tensor],
    values: List[torch.Tensor],
    index: torch.Tensor,
    mask: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache_len: int,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    wanted: List[int],
) -> List[torch.Tensor]:
    """Block.forward for every layer (same ops, same order); returns [x, states after
    each layer in `wanted`]. weights[i] = packed (wqkv, wo, w_gate_up, w_down) of layer i:
    oneDNN tensors, or MKL buffers with `originals[i]` their [out, in] originals (else
    None)."""
    B, T = x.size(0), x.size(1)
    q_kv = (num_heads + num_kv_heads) * head_dim
    kv = num_kv_heads * head_dim
    rows = B * T
    scale = head_dim**-0.5
    out: List[torch.Tensor] = [x]
    for i in range(len(weights)):
        w, o_w = weights[i], originals[i]
        h = ops.rms_norm(x, attn_norm[i], eps)
        qkv = _product(h, w[0], o_w[0], rows)
        v = qkv.narrow(-1, q_kv, kv).view(B, T, num_kv_heads, head_dim)
        qk = qkv.narrow(-1, 0, q_kv).view(B, T, num_heads + num_kv_heads, head_dim)
        qk = ops.apply_rotary(qk, cos, sin)
        q, k = qk.narrow(2, 0, num_heads), qk.narrow(2, num_heads, num_kv_heads)
        keys[i].view(-1, head_dim).index_put_([index], k)  # LayerKV.write
        values[i].view(-1, head_dim).index_put_([index], v)
        k_seen, v_seen = keys[i].narrow(2, 0, cache_len), values[i].narrow(2, 0, cache_len)
        o = ops.attention(q, k_seen, v_seen, mask, scale)
        x = x + _product(o, w[1], o_w[1], rows)
        h = ops.rms_norm(x, mlp_norm[i], eps)
        gu = _product(h, w[2], o_w[2], rows)
        gate, up = gu.chunk(2, -1)
        a = F.silu(gate) * up
        x = x + _product(a, w[3], o_w[3], rows)
        if i + 1 in wanted:
            out.append(x)
    out[0] = x
    return out


@functools.cache
def _scripted():
    """The scripted `_layers`, or None where TorchScript cannot compile it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # known; see the module
            return torch.jit.script(_layers)
    except Exception as e:  # noqa: BLE001 (any failure means: run eager)
        warnings.warn(f"scripted decode layers unavailable, running eager: {e}", stacklevel=2)
        return None


def applies(model: nn.Module, x: torch.Tensor, packed: list | None) -> bool:
    """Whether `run` serves this forward of `model` (a `transformer.Transformer`; see the
    module docstring)."""
    cfg = model.cfg
    return (
        _enabled
        and packed is not None
        and x.is_cpu
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
        and not cfg.attention_bias
        and not cfg.qk_norm
        and model.lora_spec is None  # adapters in the forward: the eager layers add them
        and _scripted() is not None
    )


def run(
    model: nn.Module,
    x: torch.Tensor,
    mask: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: KVCache,
    index: torch.Tensor,
    slot_start: int,
    cache_len: int,
    packed: list[dict],
    wanted: set[int],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Every layer of `model` (a `transformer.Transformer`) on x ([B, T, H]) with cache
    slots slot_start..; returns the last layer's output and {i: state after layer i} for
    i in `wanted` (1..L)."""
    cfg = model.cfg
    B = x.shape[0]
    rows = slice(slot_start, slot_start + B)
    layers = packed[: cfg.num_layers]
    mkl = isinstance(layers[0]["wqkv"], MklPacked)
    weights = [[p[n].buffer if mkl else p[n] for n in ops.MATRICES] for p in layers]
    originals = [[p[n].weight_t if mkl else None for n in ops.MATRICES] for p in layers]
    order = sorted(i for i in wanted if 1 <= i <= cfg.num_layers)
    out = _scripted()(
        x,
        [layer.attn_norm for layer in model.layers],
        [layer.mlp_norm for layer in model.layers],
        weights,
        originals,
        [cache.k[i, rows] for i in range(cfg.num_layers)],
        [cache.v[i, rows] for i in range(cfg.num_layers)],
        index,
        mask,
        rope[0],
        rope[1],
        cache_len,
        cfg.rms_norm_eps,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        order,
    )
    return out[0], dict(zip(order, out[1:], strict=True))
