"""Prompts a `generate` call has prefilled, kept so that a repeated prompt is copied into
its row, not computed again.

GRPO asks for every prompt `group_size` times. In the default rollout (8 prompts x 8 on
SmolLM2-135M, 2-core Zen 4) the prefill took 3.6 of 16 s of plain decoding, seven
eighths of it recomputing prompts already computed. What a prefill leaves for a row —
its keys and values, the logits at its last prompt position (its first token's
distribution) and the hidden states a drafter reads — depends on the prompt's tokens
and the weights alone, and the weights are fixed within a call. So the first row with a
prompt computes it, and every later row of the call with the same prompt, in the same
prefill or a later one, takes copies of what it left.

The copies are kept, least recently used first out, within `REUSE_SHARE` of the KV
cache's bytes (the default rollout's prompts take 1.8 MB each against a 260 MB cache).
A prompt that comes back after its copies were dropped is computed again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from specroll.model.kv_cache import KVCache

REUSE_SHARE = 8
"""The kept copies take at most 1 / REUSE_SHARE of the KV cache's bytes."""
ENABLED = True
"""Reuse prompts (benchmarks/prompt_reuse.py times the plain prefill against it)."""


@dataclass
class Prefilled:
    """What the prefill of one prompt of n tokens leaves for its row."""

    k: torch.Tensor
    """[L, Hkv, n, hd] its keys in every layer."""
    v: torch.Tensor
    logits: torch.Tensor
    """[V] fp32 at its last position: its first token's logits."""
    hidden: dict[int, torch.Tensor]
    """{i: [n, H]} the residual stream after layer i, for the layers a drafter reads."""

    @property
    def nbytes(self) -> int:
        parts = [self.k, self.v, self.logits, *self.hidden.values()]
        return sum(t.numel() * t.element_size() for t in parts)


class PromptReuse:
    """Prefilled prompts by their token ids, least recently used first out."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.kept: OrderedDict[tuple[int, ...], Prefilled] = OrderedDict()
        self.used = 0
        self.reused = 0
        """Rows that took a copy instead of computing their prompt."""

    @classmethod
    def for_cache(cls, cache: KVCache) -> PromptReuse:
        return cls((cache.k.nbytes + cache.v.nbytes) // REUSE_SHARE)

    def get(self, key: tuple[int, ...]) -> Prefilled | None:
        entry = self.kept.get(key)
        if entry is not None:
            self.kept.move_to_end(key)
        return entry

    def put(self, key: tuple[int, ...], entry: Prefilled) -> None:
        size = entry.nbytes
        if size > self.budget or key in self.kept:
            return
        while self.used + size > self.budget:
            self.used -= self.kept.popitem(last=False)[1].nbytes
        self.kept[key] = entry
        self.used += size


def prefill_rows(
    model: nn.Module,
    cache: KVCache,
    reuse: PromptReuse,
    prompts: Sequence[list[int]],
    tokens: torch.Tensor,
    slot_start: int,
    hidden_layers: Sequence[int],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Fill cache slots slot_start.. with `prompts` (one row each, new rows; `tokens`
    [G, W] the same, padded, on the cache's device), computing only the prompts `reuse`
    does not hold and the first of each repeat.

    Returns (logits [G, 1, V] at each row's last prompt position, {i: [G, W, H]} hidden
    states, W = the longest prompt, zero past a row's own length). With every prompt
    new and distinct this is the plain prefill forward's own output."""
    keys = [tuple(p) for p in prompts]
    if not ENABLED:
        out = _forward(model, cache, tokens, keys, slot_start, hidden_layers)
        return out.logits, out.hidden
    found = {key: reuse.get(key) for key in keys}
    first = {}  # each prompt not held: its first row
    for r, key in enumerate(keys):
        if found[key] is None:
            first.setdefault(key, r)
    new = list(first)  # first-seen order
    if len(new) < len(keys) and new:  # (all new and distinct: the rows as they are)
        tokens = tokens[torch.tensor(list(first.values()), device=tokens.device)]
    out = _forward(model, cache, tokens, new, slot_start, hidden_layers) if new else None
    for u, key in enumerate(new):
        found[key] = _kept(cache, out, slot_start, u, key)
        reuse.put(key, found[key])
    if len(new) == len(keys):  # every row computed, in its own slot: nothing to copy
        return out.logits, out.hidden
    reuse.reused += len(keys) - len(new)
    entries = [found[key] for key in keys]
    for r, e in enumerate(entries):  # (the forward's slots are among these rows': no loss)
        n = e.k.shape[2]
        cache.k[:, slot_start + r, :, :n] = e.k
        cache.v[:, slot_start + r, :, :n] = e.v
    logits = torch.stack([e.logits for e in entries]).unsqueeze(1)  # [G, 1, V]
    width = max(len(key) for key in keys)
    hidden = {
        i: torch.stack(
            [torch.nn.functional.pad(e.hidden[i], (0, 0, 0, width - e.k.shape[2])) for e in entries]
        )
        for i in entries[0].hidden
    }
    return logits, hidden


def _forward(model, cache: KVCache, tokens: torch.Tensor, prompts, slot_start: int, layers):
    """The prefill forward of `prompts` (`tokens` [U, W], padded) into slots slot_start.."""
    dev = cache.k.device
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    return model(
        tokens,
        positions=torch.zeros(len(prompts), dtype=torch.long, device=dev),
        cache=cache,
        logits_index=(lengths - 1).unsqueeze(1),
        hidden_layers=layers,
        slot_start=slot_start,
        max_start=0,
    )


def _kept(cache: KVCache, out, slot_start: int, u: int, key: tuple[int, ...]) -> Prefilled:
    """Copies of what the forward left for its row u (prompt `key`)."""
    n, s = len(key), slot_start + u
    return Prefilled(
        cache.k[:, s, :, :n].clone(),
        cache.v[:, s, :, :n].clone(),
        out.logits[u, 0].clone(),
        {i: h[u, :n].clone() for i, h in out.hidden.items()},
    )
