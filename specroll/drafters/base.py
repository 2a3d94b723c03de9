"""The interface between the engine and a drafter.

A drafter only *proposes*: the engine decides how many tokens each row may draft, runs the
target over them, and `spec.verify` decides what is accepted. A drafter never sees the
acceptance uniforms; drafters that sample draw from their own RNG stream (`rng.DRAFT`)
and must return the exact processed distribution `q` they sampled from.

Per generate() call the engine calls, in order:
  start(num_slots, max_len)            fresh state for a new batch of requests
  prefill(start, prompts, hidden)      rows start.. were just admitted (target prefill done)
  propose(batch) -> Proposal           once per speculative iteration (k >= 1)
  commit(B, pos_before, num_new, hidden)
                                       after every target forward: num_new[b] tokens of
                                       row b entered the target cache at pos_before[b]..
  move(src, dst)                       row src now lives in slot dst (compaction)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftBatch:
    """What a drafter may look at when proposing for active rows 0..B-1."""

    k: int
    """Tokens to propose per row (rows may use fewer: see num_draft)."""
    num_draft: torch.Tensor
    """[B] how many of the k tokens the engine will verify for each row (0..k)."""
    last: torch.Tensor
    """[B] newest token of each row (not yet in the target's KV cache)."""
    pos: torch.Tensor
    """[B] tokens already in the target's cache (= position of `last`)."""
    history: torch.Tensor
    """[S, L] prompt + generated ids per slot; row b is valid up to pos[b] (inclusive)."""
    temperature: torch.Tensor
    """[B] sampling temperature (0 = greedy)."""
    top_k: torch.Tensor
    """[B] top-k (0 = off)."""
    top_p: torch.Tensor
    """[B] top-p (1 = off)."""
    seed: torch.Tensor
    """[B] request seeds (for rng.DRAFT)."""
    n_gen: torch.Tensor
    """[B] tokens generated so far: draft i of row b is generated token n_gen[b] + i."""


@dataclass
class Proposal:
    tokens: torch.Tensor
    """[B, k] proposed ids."""
    probs: torch.Tensor | None
    """[B, k, V] processed q each token was sampled from; None = deterministic (one-hot)."""
    lengths: torch.Tensor | None = None
    """[B] usable proposed tokens per row (<= k), e.g. no n-gram match; None = all k."""


class Drafter:
    """Base class: a drafter that keeps no state needs only `propose`."""

    name = "drafter"
    version = 0
    """Weight version of the draft (reported in warnings and metrics)."""
    hidden_layers: tuple[int, ...] = ()
    """Target residual-stream states the drafter needs from prefill and verify forwards."""

    def start(self, num_slots: int, max_len: int) -> None:
        pass

    def prefill(
        self, start: int, prompts: list[list[int]], hidden: dict[int, torch.Tensor]
    ) -> None:
        pass

    def propose(self, batch: DraftBatch) -> Proposal:
        raise NotImplementedError

    def commit(
        self,
        B: int,
        pos_before: torch.Tensor,
        num_new: torch.Tensor,
        hidden: dict[int, torch.Tensor],
    ) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass
