"""The interface between the engine and a drafter.

A drafter only *proposes*: the engine decides how many tokens each row may draft, runs the
target over them, and `spec.verify` decides what is accepted. A drafter never sees the
acceptance uniforms; drafters that sample draw from their own RNG stream (`rng.DRAFT`)
and must return the exact processed distribution `q` they sampled from.

Per generate() call the engine calls, in order:
  start(num_slots, max_len)            fresh state for a new batch of requests
  prefill(start, seqs, hidden)         rows start.. were just admitted: seqs[r] = prompt +
                                       the first generated token; hidden = target states
                                       over the prompt positions
  propose(batch) -> Proposal           once per speculative iteration (k >= 1)
  commit(B, pos_before, num_new, hidden, history)
                                       after every target forward: num_new[b] tokens of
                                       row b entered the target cache at pos_before[b]..
                                       (hidden: the target states of that forward)
  move(src, dst)                       row src now lives in slot dst (compaction)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specroll.spec import rng
from specroll.spec.sampling import probs_from_logits, sample_from_probs


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

    def prefill(self, start: int, seqs: list[list[int]], hidden: dict[int, torch.Tensor]) -> None:
        pass

    def propose(self, batch: DraftBatch) -> Proposal:
        raise NotImplementedError

    def commit(
        self,
        B: int,
        pos_before: torch.Tensor,
        num_new: torch.Tensor,
        hidden: dict[int, torch.Tensor],
        history: torch.Tensor,
    ) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass


class FeatureDrafter(Drafter):
    """Shared loop of drafters conditioned on target hidden states (EAGLE-3, MTP).

    Pair t is (target feature h_t, token x_{t+1}) and its output predicts x_{t+2}. Every
    committed pair is fed from the *target's* features right after verification (vLLM
    PR #14464: keeping the draft's own recursive KV for committed positions silently
    lowers acceptance), so the draft cache always holds exactly the target's `pos` pairs
    and a proposal starts from the saved output of pair pos-1, then drafts recursively,
    feeding back the draft's own state. Tokens are sampled from the processed q over the
    target vocabulary. Subclasses provide the network through four small hooks.
    """

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.cache = None

    # hooks ---------------------------------------------------------------------------
    def new_cache(self, num_slots: int, max_len: int):
        """The draft network's own KV cache (row b ↔ slot b)."""
        raise NotImplementedError

    def features(self, hidden: dict[int, torch.Tensor], width: int) -> torch.Tensor:
        """Target states of a forward ([n, T, H] each) → draft conditioning [n, width, H]."""
        raise NotImplementedError

    def run(self, depth: int, tokens, feats, positions, slot_start: int = 0):
        """Draft network at recursion depth `depth` → (logits [n, T, *], state [n, T, H])."""
        raise NotImplementedError

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits → [..., V] over the target vocabulary."""
        return logits

    # loop ----------------------------------------------------------------------------
    def start(self, num_slots: int, max_len: int) -> None:
        c = self.cache
        if c is None or c.num_slots < num_slots or c.max_len < max_len:
            self.cache = None
            self.cache = self.new_cache(num_slots, max_len)
        self.dpos = torch.zeros(self.cache.num_slots, dtype=torch.long)  # = target pos
        self.next_logits: torch.Tensor | None = None  # [S, *] output of pair dpos-1
        self.next_state: torch.Tensor | None = None  # [S, H]

    def _feed(self, start: int, tokens: torch.Tensor, hidden: dict, counts: torch.Tensor) -> None:
        """Feed counts[r] pairs per row (tokens and features padded to a common width)."""
        n, width = tokens.shape
        rows = torch.arange(start, start + n)
        logits, state = self.run(0, tokens, self.features(hidden, width), self.dpos[rows], start)
        last, ar = (counts - 1).clamp(min=0), torch.arange(n)
        if self.next_logits is None:
            S = self.cache.num_slots
            self.next_logits = logits.new_zeros(S, logits.shape[-1])
            self.next_state = state.new_zeros(S, state.shape[-1])
        self.next_logits[rows] = logits[ar, last]
        self.next_state[rows] = state[ar, last]
        self.dpos[rows] += counts

    @torch.inference_mode()
    def prefill(self, start: int, seqs: list[list[int]], hidden) -> None:
        width = max(len(q) for q in seqs) - 1
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, q in enumerate(seqs):
            tokens[r, : len(q) - 1] = torch.tensor(q[1:])  # pair t: (h_t, x_{t+1})
        self.dpos[start : start + len(seqs)] = 0
        self._feed(start, tokens, hidden, torch.tensor([len(q) - 1 for q in seqs]))

    @torch.inference_mode()
    def commit(self, B, pos_before, num_new, hidden, history) -> None:
        K1 = next(iter(hidden.values())).shape[1]
        idx = (pos_before.unsqueeze(1) + 1 + torch.arange(K1)).clamp(max=history.shape[1] - 1)
        self._feed(0, history[:B].gather(1, idx), hidden, num_new)  # x_{t+1}, t = pos + j

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        B, k = batch.last.shape[0], batch.k
        logits, state = self.next_logits[:B], self.next_state[:B]
        tokens, probs = [], []
        for i in range(k):
            full = self.to_target_logits(logits)  # [B, V]
            q = probs_from_logits(full, batch.temperature, batch.top_k, batch.top_p)
            tok = sample_from_probs(q, rng.uniforms(batch.seed, batch.n_gen + i, rng.DRAFT))
            tok = torch.where(batch.temperature <= 0, full.argmax(dim=-1), tok)
            tokens.append(tok)
            probs.append(q)
            if i + 1 < k:  # pair (own state, draft i) at position pos + i
                lg, st = self.run(i + 1, tok.unsqueeze(1), state.unsqueeze(1), batch.pos + i)
                logits, state = lg[:, 0], st[:, 0]
        return Proposal(tokens=torch.stack(tokens, 1), probs=torch.stack(probs, 1))

    def move(self, src: int, dst: int) -> None:
        self.cache.move(src, dst, int(self.dpos[src]))
        for t in (self.dpos, self.next_logits, self.next_state):
            t[dst] = t[src]
