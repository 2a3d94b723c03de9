"""The Llama-family decoder shared by the rollout engine and the learner.

One module, two call patterns, one set of numerics:

* learner: `model(tokens)` — full-sequence causal forward with autograd;
* engine:  `model(tokens, positions, cache)` — incremental forward where row b of the batch
  lives in cache slot b, starts at its own position `positions[b]` and appends `T` tokens
  (rows advance by different amounts; padded tail tokens are written but never attended).

Both paths run the same attention function with an explicit mask (built boolean, made
additive once per forward), so the engine's log-probs equal the learner's recomputation to
float rounding (checked by a test).

Weights are stored input-major (`[in, out]`, used as `x @ w`; with autograd this is the
faster plain-BLAS layout for few-row products). Grad-free CPU forwards (the engine) use
prepacked copies instead (MKL on Intel CPUs, oneDNN elsewhere: `specroll.model.packed`):
a packed product of a few rows costs about what one row costs, which is what makes
verifying k draft tokens cheap (`specroll bench engine`, field `verify_cost`, and
`benchmarks/gemm_stack.py` measure it on the machine at hand). The packed copies are
rebuilt automatically whenever a weight changes (tracked by tensor version counters).
GQA is computed by folding the query heads that share a KV head into the query-length
axis, so keys and values are never copied. The engine's fp32 CPU forward runs the same
layer ops as one TorchScript function (`specroll.model.decode`: no Python between the
kernels, the eager loop's result bit for bit).

Dtypes: the weights, activations and KV cache are in the weights' dtype (fp32, or bf16
for a bf16 engine: `weights.for_inference`); RoPE tables stay fp32 and the rotation is
computed in fp32, norms follow transformers (`rms_norm`), and the logits are upcast to
fp32, so every sampler and the verifier see fp32. bf16 weights are prepacked too where
the CPU has native bf16 (AVX-512 BF16 / AMX), faster there than a plain bf16 matmul.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specroll.model import decode
from specroll.model.config import ModelConfig, rope_inv_freq
from specroll.model.packed import PackedWeights
from specroll.model.packed import packed_mm as _mm

MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")
"""A block's weight matrices, stored [in, out] (HF stores [out, in]); what gets prepacked."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, as transformers computes it in every dtype.

    fp32: `F.rms_norm` (the fused kernel; the fp32 numerics of engine and learner). Lower
    precision: normalise in fp32, round to x's dtype, then scale by the weight in that
    dtype (HF's `weight * hidden.to(input_dtype)`), so a bf16 engine matches a bf16 HF model.
    """
    if x.dtype == torch.float32:
        if x.is_cpu and not torch.is_grad_enabled():
            # F.rms_norm's CPU arithmetic (pow 2 is x * x) in 5 kernels instead of 9,
            # bit for bit: a decode step runs 61 norms of a few rows each
            y = x * torch.mean(x * x, -1, keepdim=True).add_(eps).rsqrt_()
            return y if weight is None else y.mul_(weight)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return y if weight is None else weight * y


@dataclass
class ModelOutput:
    logits: torch.Tensor | None
    """[B, n, V] fp32 logits at the requested positions (n = T unless `logits_index` is set);
    a bf16 model's logits are its bf16 LM-head product, upcast."""
    hidden: dict[int, torch.Tensor]
    """Residual stream after i layers ([B, T, H]) for each requested i (0 = embeddings,
    num_layers = last layer before the final norm)."""


class KVCache:
    """Fixed-size key/value cache: `num_slots` rows of `max_len` positions per layer.

    Row b of an engine batch always uses slot b; the engine keeps its active rows in the
    first slots (`move` compacts them when a row finishes).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, Hkv, max_len, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len = num_slots, max_len

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst`."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def write_index(self, pos: torch.Tensor) -> torch.Tensor:
        """[B, T, Hkv]: where each row's T new tokens go, per KV head, as rows of a slot
        range's keys viewed `[B * Hkv * max_len, hd]`; pos: [B, T] their positions. The
        same for every layer, so a forward makes it once (see `LayerKV.write`)."""
        B, hkv = pos.shape[0], self.k.shape[2]
        base = torch.arange(B * hkv, device=pos.device).view(B, 1, hkv) * self.max_len
        return base + pos.unsqueeze(-1)

    def layer(self, i: int, slot_start: int, index: torch.Tensor) -> LayerKV:
        """Layer i's keys and values for slots slot_start.. (one per row of `index`)."""
        rows = slice(slot_start, slot_start + index.shape[0])
        return LayerKV(self.k[i, rows], self.v[i, rows], index)


class LayerKV(NamedTuple):
    """One layer's cache for a batch's slots, and where its new tokens go."""

    k: torch.Tensor
    """[B, Hkv, max_len, hd] view of the batch's slots (contiguous: slots are adjacent)."""
    v: torch.Tensor
    index: torch.Tensor
    """[B, T, Hkv] from `KVCache.write_index`."""

    def write(
        self, k: torch.Tensor, v: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, T, Hkv, hd]) at each row's own positions; return the first
        `length` positions of every slot ([B, Hkv, length, hd] views). One flat
        `index_put_` per tensor: a third of the time of indexing (rows, :, pos)."""
        hd = self.k.shape[-1]
        self.k.view(-1, hd).index_put_((self.index,), k)
        self.v.view(-1, hd).index_put_((self.index,), v)
        return self.k[:, :, :length], self.v[:, :, :length]


class KeyChain:
    """Keys and values of the earlier steps of a training-time-test unroll (drafters).

    Passed where a layer takes its cache: each step appends its own keys/values by
    concatenation (never in place, so autograd can differentiate through every step) and
    attends over all steps so far under a caller-built mask.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [B, Hkv, steps*T, hd]
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's k, v ([B, T, Hkv, hd]); return every step's ([B, Hkv, L, hd])."""
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class Rotary(nn.Module):
    """cos/sin tables for every position up to the context window (fp32, like HF).

    The tables stay fp32 whatever `module.to(dtype=...)` asks (see `_apply`): rounding
    them to bf16 would move the phase of far positions by whole percent (the rotation
    itself is computed in fp32 by `apply_rotary` and rounded once). `sin` has its first
    half negated, which turns rotate-half into a roll (see `apply_rotary`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(cfg)
        pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, hd]
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        sin = emb.sin() * scale
        sin[:, : sin.shape[1] // 2].neg_()  # [-sin, sin]: rotate_half's sign, folded in
        self.register_buffer("sin", sin, persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """Follow device moves but keep the fp32 tables (a dtype cast is not applied)."""
        cos, sin = self.cos, self.sin
        super()._apply(fn, recurse)
        dev = self.cos.device
        self.cos, self.sin = cos.to(device=dev), sin.to(device=dev)
        return self

    def forward(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pos: [B, T] absolute positions → (cos, sin), each [B, T, 1, hd] fp32."""
        return self.cos[pos].unsqueeze(2), self.sin[pos].unsqueeze(2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [B, T, heads, hd] with cos/sin [B, T, 1, hd] from `Rotary`.

    rotate_half(x) * sin = [-x2, x1] * [s, s] = roll(x, hd/2) * [-s, s]: the sign lives in
    Rotary's table, so this is transformers' arithmetic bit for bit, in 4 kernels, not 6.
    A bf16 x is rotated in fp32 and rounded back once (fp32 x: unchanged numerics)."""
    xf = x.to(cos.dtype)  # fp32: x itself
    # sin needs no grad, so roll's output is not saved for backward: in place is safe
    return torch.roll(xf, xf.shape[-1] // 2, -1).mul_(sin).add_(xf * cos).to(x.dtype)


def fold_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """[B, T, Lk] mask → [B, 1, group*T, Lk], matching the folded queries of `attention`."""
    return mask.unsqueeze(1).repeat(1, 1, group, 1)


def attention_layout(
    cfg: ModelConfig,
    tokens: torch.Tensor,
    positions: torch.Tensor | None,
    cache: KVCache | None,
    slot_start: int = 0,
    max_start: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Positions, folded mask and key length of a forward, shared by every network here.

    Without a cache: causal over the T tokens (positions only shift RoPE). With a cache:
    row b writes its T tokens at positions[b].. of slot slot_start + b, and key j is
    visible to query i iff j <= positions[b] + i. Returns (pos [B, T], mask
    [B, 1, g*T, Lk], Lk), checking the context window and the cache's capacity.
    `max_start`: max(positions) when the caller knows it on the host (the engine does),
    so that sizing the key axis reads nothing back from the device.
    """
    B, T = tokens.shape
    dev = tokens.device
    start = torch.zeros(B, dtype=torch.long, device=dev) if positions is None else positions
    pos = start.unsqueeze(1) + torch.arange(T, device=dev)  # [B, T]
    if max_start is None:
        max_start = 0 if positions is None else int(start.max())
    if max_start + T - 1 >= cfg.max_position_embeddings:
        raise ValueError(
            f"position {max_start + T - 1} exceeds the context window "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    if cache is None:
        key_len = T
        local = torch.arange(T, device=dev)
        mask = (local.view(1, -1) <= local.view(-1, 1)).expand(B, T, T)  # [B, T, T]
    else:
        key_len = max_start + T
        if key_len > cache.max_len or slot_start + B > cache.num_slots:
            raise ValueError(
                f"batch needs slots up to {slot_start + B} x {key_len} positions; "
                f"the cache has {cache.num_slots} x {cache.max_len}"
            )
        kpos = torch.arange(key_len, device=dev)
        mask = kpos.view(1, 1, -1) <= pos.unsqueeze(-1)  # [B, T, Lk]
    return pos, fold_mask(mask, cfg.num_heads // cfg.num_kv_heads), key_len


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask (True = attend) as SDPA applies it: 0 where True, -inf
    elsewhere, in `dtype` (the queries')."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention without copying K/V.

    q: [B, T, Hq, hd]; k, v: [B, Hkv, Lk, hd] (may be strided views of the cache);
    mask: [B, 1, g*T, Lk] bool (True = attend), already folded by `fold_mask`, or the
    same as an additive mask in q's dtype (0 / -inf, `additive_mask`: what SDPA turns a
    bool mask into on every call; a forward makes it once for all its layers).
    Returns [B, T, Hq * hd].
    """
    B, T, Hq, hd = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    # query head h = kv * g + j attends KV head kv; fold j into the query axis
    qf = q.view(B, T, Hkv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * T, hd)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)
    return out.view(B, Hkv, g, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, Hq * hd)


class Block(nn.Module):
    """Pre-norm decoder layer: RMSNorm → GQA attention → RMSNorm → SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        self.cfg = cfg
        self.attn_norm = nn.Parameter(torch.ones(H))
        self.wqkv = nn.Parameter(torch.empty(H, q + 2 * kv))  # [H, q + 2kv]
        self.bqkv = nn.Parameter(torch.zeros(q + 2 * kv)) if cfg.attention_bias else None
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.wo = nn.Parameter(torch.empty(q, H))  # [q, H]
        self.mlp_norm = nn.Parameter(torch.ones(H))
        self.w_gate_up = nn.Parameter(torch.empty(H, 2 * inter))  # [H, 2I]
        self.w_down = nn.Parameter(torch.empty(inter, H))  # [I, H]

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer_cache: LayerKV | KeyChain | None,
        cache_len: int,
        packed: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        pk = packed or {}
        B, T, _ = x.shape
        eps = cfg.rms_norm_eps
        h = rms_norm(x, self.attn_norm, eps)
        qkv = _mm(h, self.wqkv, pk.get("wqkv"))  # [B, T, q + 2kv]
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(B, T, cfg.num_heads, cfg.head_dim)
        k = k.view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(B, T, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, eps)
            k = rms_norm(k, self.k_norm, eps)
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        else:  # q and k are adjacent in qkv: one rotation of both (half the kernels)
            qk = qkv[..., : cfg.q_size + cfg.kv_size].view(B, T, -1, cfg.head_dim)
            q, k = apply_rotary(qk, *rope).split([cfg.num_heads, cfg.num_kv_heads], dim=2)
        if layer_cache is None:
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, hd]
        elif isinstance(layer_cache, KeyChain):
            keys, values = layer_cache.extend(k, v)
        else:  # each row writes its T tokens at its own positions
            keys, values = layer_cache.write(k, v, cache_len)
        o = attention(q, keys, values, mask, cfg.head_dim**-0.5)
        x = x + _mm(o, self.wo, pk.get("wo"))
        h = rms_norm(x, self.mlp_norm, eps)
        gate, up = _mm(h, self.w_gate_up, pk.get("w_gate_up")).chunk(2, dim=-1)
        return x + _mm(F.silu(gate) * up, self.w_down, pk.get("w_down"))


class Transformer(nn.Module):
    """Llama / Qwen2 / Qwen3 / SmolLM2 decoder-only language model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # token embedding stored [H, V]: the tied LM head is then a plain `x @ embed`
        self.embed = nn.Parameter(torch.empty(cfg.hidden_size, cfg.vocab_size))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.hidden_size, cfg.vocab_size))
        )
        self.rotary = Rotary(cfg)
        self.use_packed = True
        """Use oneDNN-prepacked weights in grad-free CPU forwards (see module docstring)."""
        self._packed = PackedWeights()

    def for_training(self) -> Transformer:
        """Forwards use the parameters themselves, never prepacked copies (which carry no
        autograd and would go stale under an optimizer): the learner's policy."""
        self.use_packed = False
        return self

    def init_weights(self, seed: int = 0, std: float = 0.02) -> Transformer:
        """Random normal init (tiny test models); norms start at one, biases at zero."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if "norm" in name:
                    p.fill_(1.0)
                else:  # matrices and biases
                    p.normal_(0.0, std, generator=g)
        return self

    def final_state(self, h: torch.Tensor) -> torch.Tensor:
        """The residual stream after the last layer [..., H] -> the normed final state
        (the policy's logits are `final_state(h) @ head_weight`; MTP heads read it)."""
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    def packed_weights(self) -> list[dict[str, torch.Tensor]] | None:
        """Per-layer prepacked matrices (+ {"head": LM head} last), or None (see
        PackedWeights; also None when `use_packed` is off)."""
        if not self.use_packed:
            return None
        mats = [getattr(b, n) for b in self.layers for n in MATRICES] + [self.head_weight]
        m = len(MATRICES)

        def arrange(p: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
            per_layer = [
                dict(zip(MATRICES, p[i : i + m], strict=True)) for i in range(0, len(p) - 1, m)
            ]
            return per_layer + [{"head": p[-1]}]

        return self._packed.get(mats, arrange)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head  # [H, V]

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] ids → [B, T, H] embeddings."""
        B, T = tokens.shape
        return self.embed.index_select(1, tokens.reshape(-1)).T.reshape(B, T, -1)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        logits_index: torch.Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        return_logits: bool = True,
        slot_start: int = 0,
        max_start: int | None = None,
    ) -> ModelOutput:
        """Run the decoder.

        tokens: [B, T] ids. positions: [B] start position of each row (engine mode, with
        `cache`); None means every row starts at 0. logits_index: [B, n] indices into T of
        the positions that need logits (the LM head is the costliest matmul at prefill).
        hidden_layers: which residual-stream states to return (see ModelOutput.hidden).
        slot_start: row b uses cache slot slot_start + b (lets the engine prefill new rows
        behind the ones already decoding). max_start: max(positions), when the caller
        knows it on the host (see `attention_layout`).
        """
        cfg = self.cfg
        B, T = tokens.shape
        pos, mask, cache_len = attention_layout(
            cfg, tokens, positions, cache, slot_start, max_start
        )
        rope = self.rotary(pos)

        packed = self.packed_weights()
        x = self.embed_tokens(tokens)
        mask = additive_mask(mask, x.dtype)  # once, not in every layer's SDPA
        hidden: dict[int, torch.Tensor] = {}
        wanted = set(hidden_layers)
        if 0 in wanted:
            hidden[0] = x
        index = None if cache is None else cache.write_index(pos)  # once for all layers
        if cache is not None and decode.applies(self, x, packed):
            # the same ops without Python in between: the engine's CPU forward
            x, states = decode.run(
                self, x, mask, rope, cache, index, slot_start, cache_len, packed, wanted
            )
            hidden |= states
        else:
            for i, layer in enumerate(self.layers):
                lc = None if cache is None else cache.layer(i, slot_start, index)
                x = layer(x, pos, mask, rope, lc, cache_len, packed and packed[i])
                if i + 1 in wanted:
                    hidden[i + 1] = x
        if not return_logits:
            return ModelOutput(None, hidden)
        if logits_index is not None:
            x = x.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        x = self.final_state(x)
        head = packed[-1]["head"] if packed else None
        # logits in the weights' dtype, upcast: sampling and verification run in fp32
        return ModelOutput(_mm(x, self.head_weight, head).float(), hidden)
