"""Key/value caches: the engine's per-slot cache and the drafters' training-time-test chain."""

from __future__ import annotations

from typing import NamedTuple

import torch

from specroll.model.config import ModelConfig


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
        `index_put_` per tensor, cheaper than indexing (rows, :, pos)."""
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
