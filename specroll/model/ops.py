"""The decoder's layer ops: what the eager layers (`transformer.Block`), the scripted
decode layers (`decode`) and the drafters all compute with, defined once.

Attention runs with an explicit mask (built boolean by `attention_layout`, made additive
once per forward by `additive_mask`), so the engine's incremental forward and the
learner's full-sequence forward share their numerics. GQA is computed by folding the
query heads that share a KV head into the query-length axis (`fold_mask`, `attention`),
so keys and values are never copied.

Dtypes: RoPE tables stay fp32 and the rotation is computed in fp32 (`Rotary`,
`apply_rotary`); norms follow transformers in every dtype (`rms_norm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specroll.model.config import ModelConfig, rope_inv_freq
from specroll.model.kv_cache import KVCache

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


ROPE_CHUNK = 1024
"""Positions per block of the RoPE tables: they grow a block at a time, up to what a
forward reaches, never to the window a config.json states."""


class Rotary(nn.Module):
    """cos/sin tables for the positions forwards have reached (fp32, like HF).

    A config's `max_position_embeddings` bounds the positions but sizes nothing: the
    tables cover the first block and grow by whole blocks when a forward reaches further
    (`cover`; a KV-cache forward covers its whole cache at once, so a captured step never
    grows them). Each block is computed alone, so a position's value never depends on
    how far the table has grown. The tables stay fp32 whatever `module.to(dtype=...)`
    asks (see `_apply`): rounding them to bf16 would move the phase of far positions by
    whole percent (the rotation itself is computed in fp32 by `apply_rotary` and rounded
    once). `sin` has its first half negated, which turns rotate-half into a roll (see
    `apply_rotary`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.limit = cfg.max_position_embeddings
        inv_freq, self.scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        empty = torch.empty(0, cfg.head_dim)
        self.register_buffer("cos", empty, persistent=False)
        self.register_buffer("sin", empty.clone(), persistent=False)
        self.cover(1)

    def _block(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq
        pos = torch.arange(i * ROPE_CHUNK, (i + 1) * ROPE_CHUNK, device=inv.device)
        freqs = torch.outer(pos.float(), inv)  # [C, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [C, hd]
        sin = emb.sin() * self.scale
        sin[:, : sin.shape[1] // 2].neg_()  # [-sin, sin]: rotate_half's sign, folded in
        return emb.cos() * self.scale, sin

    def cover(self, top: int) -> None:
        """Make the tables hold positions 0..top-1 (capped at the context window; a
        position past the window is refused by `attention_layout` before it is read)."""
        top = min(top, self.limit)
        have = self.cos.shape[0]
        if top <= have:
            return
        # below the window the tables hold whole blocks; the last block may be cut
        blocks = [self._block(i) for i in range(have // ROPE_CHUNK, -(-top // ROPE_CHUNK))]
        n = min(len(blocks) * ROPE_CHUNK + have, self.limit)
        self.cos = torch.cat([self.cos, *(c for c, _ in blocks)])[:n]
        self.sin = torch.cat([self.sin, *(s for _, s in blocks)])[:n]

    def _apply(self, fn, recurse: bool = True):
        """Follow device moves but keep the fp32 tables (a dtype cast is not applied)."""
        cos, sin, inv = self.cos, self.sin, self.inv_freq
        super()._apply(fn, recurse)
        dev = self.cos.device
        self.cos, self.sin = cos.to(device=dev), sin.to(device=dev)
        self.inv_freq = inv.to(device=dev)
        return self

    def forward(self, pos: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """pos: [B, T] absolute positions, all below `top` (a host bound) → (cos, sin),
        each [B, T, 1, hd] fp32."""
        self.cover(top)
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
    tree: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Positions, folded mask, key length and position bound of a forward, shared by
    every network here.

    Without a cache: causal over the T tokens (positions only shift RoPE). With a cache:
    row b writes its T tokens at positions[b].. of slot slot_start + b, and key j is
    visible to query i iff j <= positions[b] + i. Returns (pos [B, T], mask
    [B, 1, g*T, Lk], Lk, top), checking the context window and the cache's capacity; `top`
    bounds the positions for the RoPE tables (`Rotary.forward`): the whole cache's length
    with a cache (so its tables never grow inside a captured step), else the last + 1.
    `max_start`: max(positions) when the caller knows it on the host (the engine does),
    so that sizing the key axis reads nothing back from the device.

    `tree` ([B, T, T] bool, `spec.tree.ancestors`): the T tokens are a draft tree, not a
    sequence. Token i then sits at position positions[b] + depth(i) (the returned `pos`
    is for RoPE; it is still written at cache position positions[b] + i) and sees the
    cache before positions[b] and its own ancestors among the T.
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
        if tree is None:
            mask = kpos.view(1, 1, -1) <= pos.unsqueeze(-1)  # [B, T, Lk]
        else:
            rel = kpos.view(1, -1) - start.unsqueeze(1)  # [B, Lk] key's index in the tree
            in_tree = tree.gather(2, rel.clamp(0, T - 1).unsqueeze(1).expand(B, T, key_len))
            mask = (rel < 0).unsqueeze(1) | (in_tree & (rel < T).unsqueeze(1))  # [B, T, Lk]
            pos = start.unsqueeze(1) + tree.sum(-1) - 1  # [B, T] position = root + depth
    top = max_start + T if cache is None else cache.max_len
    return pos, fold_mask(mask, cfg.num_heads // cfg.num_kv_heads), key_len, top


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
