"""The shared loop of drafters conditioned on the target's hidden states (EAGLE-3:
`drafters.eagle3`, MTP: `drafters.mtp`)."""

from __future__ import annotations

import torch

from specroll.device import upload
from specroll.drafters.base import DraftBatch, Drafter, Proposal, RowState
from specroll.spec import rng
from specroll.spec.sampling import probs_from_logits, sample_from_probs


class FeatureDrafter(Drafter):
    """Shared loop of drafters conditioned on target hidden states (EAGLE-3, MTP).

    Pair t is (target feature h_t, token x_{t+1}) and its output predicts x_{t+2}. Every
    committed pair is fed from the *target's* features (vLLM PR #14464: keeping the
    draft's own recursive KV for committed positions silently lowers acceptance), so
    before a proposal the draft cache holds exactly the target's `pos` pairs and the
    proposal starts from the output of pair pos-1, then drafts recursively, feeding back
    the draft's own state. Tokens are sampled from the processed q over the target
    vocabulary. Subclasses provide the network through four small hooks.

    Feeding is lazy: `prefill` and `commit` only store the target's features; the draft
    network (and `condition`) runs over a row's pending pairs (in one batched forward)
    when that row is next asked to propose. While the depth policy keeps speculation
    off — the large-batch head of a rollout — the drafter costs nothing but a copy; when
    the batch shrinks to where drafting pays, each row catches up in a single forward.
    """

    in_step = True
    """Proposes on the device alone: inside the engine's step."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self.cache = None

    # hooks ---------------------------------------------------------------------------
    def new_cache(self, num_slots: int, max_len: int):
        """The draft network's own KV cache (row b ↔ slot b)."""
        raise NotImplementedError

    def features(self, hidden: dict[int, torch.Tensor], width: int) -> torch.Tensor:
        """Target states of a forward ([n, T, H] each) → what is kept per pair, [n, width,
        *]: the draft conditioning itself, or what `condition` computes it from."""
        raise NotImplementedError

    def condition(self, kept: torch.Tensor) -> torch.Tensor:
        """What `features` kept, [n, W, *] → draft conditioning [n, W, H], for the pairs
        fed now. The identity unless the conditioning costs a matmul (EAGLE-3's fusion):
        then it is computed here, for the pairs fed, rather than for every committed
        pair of every row (most of them, in a rollout, never drafted from)."""
        return kept

    def run(
        self,
        depth: int,
        tokens,
        feats,
        positions,
        slot_start: int = 0,
        logits_index=None,
        max_start: int | None = None,
    ):
        """Draft network at recursion depth `depth` → (logits [n, T, *], state [n, T, H]);
        with logits_index [n, m], logits only at those positions ([n, m, *]); max_start:
        max(positions), known on the host."""
        raise NotImplementedError

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits → [..., V] over the target vocabulary."""
        return logits

    # loop ----------------------------------------------------------------------------
    def start(self, num_slots: int, max_len: int, rows: RowState | None = None) -> None:
        super().start(num_slots, max_len, rows)
        c = self.cache
        fits = c is not None and c.num_slots >= num_slots and c.max_len >= max_len
        if fits and self.network is not None:  # the network may have been moved or cast
            w = next(self.network.parameters())
            fits = c.k.device == w.device and c.k.dtype == w.dtype
        if not fits:
            self.cache = None
            self.cache = self.new_cache(num_slots, max_len)
        S, L = self.cache.num_slots, self.cache.max_len
        if fits:  # the same tensors (graphs hold their addresses)
            self.dpos.zero_()
            self.fed.zero_()
            return
        self.epoch += 1
        self.device = self.cache.k.device
        long = dict(dtype=torch.long, device=self.device)
        self.dpos = torch.zeros(S, **long)  # pairs committed (= target pos)
        self.fed = torch.zeros(S, **long)  # pairs already run through the draft
        # [S, L + 1, *] kept features of pending pairs; column L takes masked-out writes
        self.feats: torch.Tensor | None = None
        self.max_len = L
        self.next_logits: torch.Tensor | None = None  # [S, *] output of pair fed-1
        self.next_state: torch.Tensor | None = None  # [S, H]

    def _store(self, rows: torch.Tensor, first: torch.Tensor, feats: torch.Tensor, counts) -> None:
        """Keep feats[r, :counts[r]] as the conditioning of pairs first[r].. of rows[r]."""
        L = self.max_len
        if self.feats is None:
            self.feats = feats.new_zeros(self.cache.num_slots, L + 1, feats.shape[-1])
        j = torch.arange(feats.shape[1], device=self.device)
        at = first.unsqueeze(1) + j  # [n, W]
        keep = (j < counts.unsqueeze(1)) & (at < L)
        self.feats[rows.unsqueeze(1), torch.where(keep, at, L)] = feats  # the rest: column L
        self.dpos[rows] = first + counts

    @torch.inference_mode()
    def catch_up(self, B: int, history: torch.Tensor) -> int:
        """Run the draft over every pending pair of rows 0..B-1: one batched forward, or
        one per lagging row when a common width would overrun the cache. Returns the
        most pairs a row had pending (0: nothing to run)."""
        fed = self.rows.draft_pos[:B]
        pending = [d - f for d, f in zip(self.rows.pos[:B], fed, strict=True)]
        most = max(pending, default=0)
        if most <= 0:
            return 0
        if max(fed) + most <= min(self.max_len, history.shape[1]) - 1:
            self._feed(0, B, history)
        else:
            for b in (b for b in range(B) if pending[b] > 0):
                self._feed(b, b + 1, history)
        return most

    def _feed(
        self,
        lo: int,
        hi: int,
        history: torch.Tensor,
        width: int | None = None,
        live: torch.Tensor | None = None,
        max_start: int | None = None,
    ) -> None:
        """Run the draft over the pending pairs of rows lo..hi-1 in one forward, `width`
        pairs wide (None: the most a row has, from the host's rows); `live`: the rows
        that are not a captured step's padding (they feed none), with width and
        max_start fixed by the step (`propose`)."""
        rows = torch.arange(lo, hi, device=self.device)
        fed = start = self.fed[lo:hi]
        pending = self.dpos[lo:hi] - fed
        if live is None:
            lag = zip(self.rows.pos[lo:hi], self.rows.draft_pos[lo:hi], strict=True)
            width = max(d - f for d, f in lag)
            max_start = max(self.rows.draft_pos[lo:hi])
        else:  # (`prepare` caught up every lag longer than width)
            pending = torch.where(live, pending, 0).clamp(max=width)
            start = torch.where(live, fed, 0)  # a padding row's forward: at position 0
        col = torch.arange(width, device=self.device)
        t = (start.unsqueeze(1) + col).clamp(max=history.shape[1] - 2)  # [n, W]
        tokens = history[lo:hi].gather(1, t + 1)  # pair t: (h_t, x_{t+1}), [n, W]
        feats = self.condition(self.feats[rows.unsqueeze(1), t])  # [n, W, H]
        last = (pending - 1).clamp(min=0)  # [n] each row's last pending pair
        # only the last pair's logits are needed: reading out all W over the vocabulary
        # would cost more than the draft layer itself on a long catch-up
        logits, state = self.run(
            0,
            tokens,
            feats,
            start,
            lo,
            logits_index=last.unsqueeze(1),
            max_start=max_start,
        )
        if self.next_logits is None:
            S = self.cache.num_slots
            self.next_logits = logits.new_zeros(S, logits.shape[-1])
            self.next_state = state.new_zeros(S, state.shape[-1])
        moved = (pending > 0).unsqueeze(1)  # [n, 1] rows that had pairs to run
        self.next_logits[lo:hi] = torch.where(moved, logits[:, 0], self.next_logits[lo:hi])
        state = state.gather(1, last.view(-1, 1, 1).expand(-1, 1, state.shape[-1]))[:, 0]
        self.next_state[lo:hi] = torch.where(moved, state, self.next_state[lo:hi])
        self.fed[lo:hi] = fed + pending  # (dpos, but where padding fed none)
        if live is None:
            self.rows.draft_pos[lo:hi] = self.rows.pos[lo:hi]

    @torch.inference_mode()
    def prefill(self, start: int, seqs: list[list[int]], hidden) -> None:
        width = max(len(q) for q in seqs) - 1
        n = len(seqs)
        long = dict(dtype=torch.long, device=self.device)
        rows = torch.arange(start, start + n, **long)
        self.fed[rows] = 0
        self.rows.draft_pos[start : start + n] = [0] * n
        counts = upload([len(q) - 1 for q in seqs], self.device)
        self._store(rows, torch.zeros(n, **long), self.features(hidden, width), counts)

    @torch.inference_mode()
    def commit(self, B, pos_before, num_new, hidden, read) -> None:
        K1 = next(iter(hidden.values())).shape[1]
        rows = torch.arange(B, device=self.device)
        feats = self.features(hidden, K1)  # [B, K1, *]
        if K1 > 1 or self.feats is None:
            self._store(rows, pos_before, feats, num_new)
            return
        # a plain iteration (every iteration of a rollout's large-batch head): one pair
        # per row, kept without `_store`'s mask (a row that committed none leaves a
        # feature past its `dpos`, which nothing reads before it is written again)
        self.feats[rows, pos_before.clamp(max=self.max_len)] = feats[:, 0]
        self.dpos[:B] = pos_before + num_new

    def prepare(self, B: int, k: int, history: torch.Tensor, captured: bool) -> None:
        """Before a captured step of depth k: rows lagging more than the k + 1 pairs an
        iteration adds (speculation was off) catch up eagerly, so the step's feed, k + 1
        wide, holds every row's pending pairs; then every row is as fed."""
        if not captured:
            return
        lag = zip(self.rows.pos[:B], self.rows.draft_pos[:B], strict=True)
        if max((d - f for d, f in lag), default=0) > k + 1 or self.next_logits is None:
            self.catch_up(B, history)
        self.rows.draft_pos[:B] = self.rows.pos[:B]

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        """Eager: every row's pending pairs fed (`catch_up`), then its k drafts. Inside a
        captured step (`batch.keys`), every shape fixed: the pending pairs fed k + 1
        wide (padding rows feed none), then the k drafts over a key axis `keys` long."""
        n = batch.last.shape[0]
        if batch.keys is None:
            self.catch_up(n, batch.history)
            return self._draft(batch, None)
        W = batch.k + 1
        self._feed(0, n, batch.history, width=W, live=batch.live, max_start=batch.keys - W)
        return self._draft(batch, batch.keys - 1)

    def _draft(self, batch: DraftBatch, max_start: int | None) -> Proposal:
        """The k drafts of rows 0..n-1 from their next outputs; max_start: the key axis
        of every recursive forward (None: the rows' deepest position, from the host)."""
        n, k = batch.last.shape[0], batch.k
        logits, state = self.next_logits[:n], self.next_state[:n]
        tokens, probs = [], []
        for i in range(k):
            full = self.to_target_logits(logits).float()  # [n, V] fp32 (bf16 heads: upcast)
            q = probs_from_logits(full, batch.sampling)
            tok = sample_from_probs(q, rng.uniforms(batch.seed, batch.n_gen + i, rng.DRAFT))
            tok = torch.where(batch.sampling.greedy, full.argmax(dim=-1), tok)
            tokens.append(tok)
            probs.append(q)
            if i + 1 < k:  # pair (own state, draft i) at position pos + i
                logits, state = self._step(i + 1, tok, state, batch, i, max_start)
        return Proposal(tokens=torch.stack(tokens, 1), probs=torch.stack(probs, 1))

    def _step(
        self, depth: int, tok, state, batch: DraftBatch, i: int, max_start: int | None = None
    ):
        """One recursive draft forward: pair (own state, token) at position pos + i;
        max_start: its key axis, fixed by a captured step (None: the rows' deepest
        position plus i, from the host)."""
        top = max_start
        if top is None and batch.max_pos is not None:
            top = batch.max_pos + i
        lg, st = self.run(depth, tok.unsqueeze(1), state.unsqueeze(1), batch.pos + i, max_start=top)
        return lg[:, 0], st[:, 0]

    @torch.inference_mode()
    def candidates(self, batch: DraftBatch, depth: int, width: int) -> tuple[torch.Tensor, ...]:
        """Deterministic candidates for a draft tree (`drafters.combined`): along the draft's
        greedy path, the `width` likeliest tokens of its processed q at each of `depth`
        positions → (tokens [B, depth, width], q of each [B, depth, width]); column 0 is
        the path. Nothing is sampled: a tree's candidates are never the rows' draws."""
        B = batch.last.shape[0]
        self.catch_up(B, batch.history)
        logits, state = self.next_logits[:B], self.next_state[:B]
        tokens, probs = [], []
        for i in range(depth):
            q = probs_from_logits(self.to_target_logits(logits).float(), batch.sampling)
            p, t = q.topk(width, dim=-1)  # [B, width]
            tokens.append(t)
            probs.append(p)
            if i + 1 < depth:  # pair (own state, path token i) at position pos + i
                logits, state = self._step(i + 1, t[:, 0], state, batch, i)
        return torch.stack(tokens, 1), torch.stack(probs, 1)

    def move(self, src: int, dst: int) -> None:
        """(After the engine moved the row's host state: `rows` holds it at src too.)"""
        fed, dpos = self.rows.draft_pos[src], self.rows.pos[src]
        self.cache.move(src, dst, fed)
        for t in (self.dpos, self.fed, self.next_logits, self.next_state):
            if t is not None:
                t[dst] = t[src]
        lo, hi = fed, min(dpos, self.max_len)
        if self.feats is not None and hi > lo:  # the pairs not yet fed are all a row needs
            self.feats[dst, lo:hi] = self.feats[src, lo:hi]
