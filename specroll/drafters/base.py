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
  propose(batch) -> Proposal           once per speculative iteration (k >= 1); a
                                       drafter with `forms` makes the one batch.form names
  commit(B, pos_before, num_new, hidden, read)
                                       after every target forward: num_new[b] tokens of
                                       row b entered the target cache at pos_before[b]..
                                       (hidden: the target states of that forward; read:
                                       what the host learned of it, `Emitted`)
  release(slot, generated)             the row in `slot` finished with `generated` tokens
                                       kept (commit saw all that entered the cache, which
                                       may run past a stop token); before any move
  move(src, dst)                       row src now lives in slot dst (compaction)
  report() -> FormReport | None        after a commit that followed a proposal: what a
                                       drafter with `forms` measured of it

Host reads: the engine reads the device back once per iteration, after it (`Emitted`),
and hands drafters what the host knows (`DraftBatch.pos_host`, `.caps`, `Emitted`), so
that a drafter needs no read of its own: on a GPU each read is a stall of the stream
(`engine.syncs`). A drafter that builds tensors from host lists copies them in with
`device.upload` (pinned, non-blocking).

Devices and dtypes: a drafter works on the device of the tensors the engine hands it
(its network's, which the engine's model shares) and makes its own state there; a draft
network runs in its weights' dtype (the engine's), and the q it returns is fp32, the
exact distribution its tokens were sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specroll.device import upload
from specroll.spec import rng
from specroll.spec.sampling import RowSampling, probs_from_logits, sample_from_probs


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
    sampling: RowSampling
    """[B] the rows' temperature / top-k / top-p (the verifier processes p alike)."""
    seed: torch.Tensor
    """[B] request seeds (for rng.DRAFT)."""
    n_gen: torch.Tensor
    """[B] tokens generated so far: draft i of row b is generated token n_gen[b] + i."""
    pos_host: list[int] | None = None
    """`pos` as the host already knows it (the engine's mirror), so that a drafter need
    not read it back from the device; None: unknown."""
    caps: list[int] | None = None
    """`num_draft` as the host knows it; None: unknown."""
    form: str | None = None
    """Which of its `Drafter.forms` a drafter that has several makes (`engine.forms`);
    None: its first."""

    @property
    def max_pos(self) -> int | None:
        """max(pos) from the host mirror (None: unknown)."""
        return None if self.pos_host is None else max(self.pos_host, default=0)


@dataclass
class Emitted:
    """What the host learned of an iteration from the engine's one read, for rows
    0..B-1: a drafter that works on the host (history) takes the rows' new tokens from
    here instead of reading them back itself."""

    pos: list[int]
    """Each row's position after the iteration (the tokens in the target cache)."""
    emitted: list[int]
    """Tokens that entered each row's cache: accepted candidates, then the one drawn."""
    count: list[int]
    """Of those, the tokens kept as the row's output (cut at a stop or the budget)."""
    tokens: list[int]
    """Each row's `width` verified candidates, flat: row b's are [b * width, ...)."""
    width: int

    def entered(self, b: int) -> list[int]:
        """Row b's tokens that entered the cache this iteration."""
        return self.tokens[b * self.width : b * self.width + self.emitted[b]]

    def kept(self, b: int) -> list[int]:
        """Row b's tokens kept as output this iteration."""
        return self.tokens[b * self.width : b * self.width + self.count[b]]


@dataclass
class FormReport:
    """What a drafter with `forms` measured inside its last proposal, for the engine's
    choice of form (`engine.forms`). Seconds are wall time; None: it did not happen."""

    room: bool = False
    """Some row could draft (a cap above 0): the choice of form made a difference."""
    feed: float | None = None
    """Seconds of feeding the draft network the rows' pending pairs."""
    steady: bool = False
    """That feed held at most one iteration's pairs (not a catch-up after skipped ones)."""
    network: float | None = None
    """Seconds of the network's part of a merged tree, its feed included."""
    tokens: float | None = None
    """Tokens per row that a tree emitted (its rows with candidates)."""
    gain: float | None = None
    """... of which the network's candidates alone brought (what followed the walk's
    first step through one of them)."""


@dataclass
class Proposal:
    tokens: torch.Tensor
    """[B, k] proposed ids."""
    probs: torch.Tensor | None
    """[B, k, V] processed q each token was sampled from; None = deterministic (one-hot)."""
    lengths: torch.Tensor | None = None
    """[B] usable proposed tokens per row (<= k), e.g. no n-gram match; None = all k."""
    parents: torch.Tensor | None = None
    """[B, k] a draft tree: the parent of each proposed token, as a node index where 0 is
    the row's `last` token and j is proposed token j - 1 (parents come first: parents[b,
    j] <= j); deterministic candidates only (`probs` None), verified by `spec.tree`.
    None = a chain."""


class Drafter:
    """Base class: a drafter that keeps no state needs only `propose`."""

    name = "drafter"
    version = 0
    """Weight version of the draft (reported in warnings and metrics)."""
    hidden_layers: tuple[int, ...] = ()
    """Target residual-stream states the drafter needs from prefill and verify forwards."""
    tree = False
    """Proposes trees (`Proposal.parents`): the engine's k is then a node budget."""
    network: nn.Module | None = None
    """The weights it proposes with (None: it has none, e.g. n-gram): what
    `Engine.load_weights` copies a new draft state into."""
    watch_collapse = True
    """The engine warns when this drafter's first tokens stop being accepted (a stale or
    corrupt draft); False for drafters whose misses are no fault (history)."""
    forms: tuple[str, ...] = ()
    """The proposal forms the engine's depth policy chooses between (`engine.forms`);
    empty: the drafter proposes in one form."""
    static = False
    """Proposes on the device alone, so inside the engine's static step (`engine.graphs`,
    with CUDA graphs on): it then implements `prepare_static`, `propose_static` and
    `after_static`, and bumps `epoch` whenever it makes its tensors anew. (A subclass
    that changes `propose` changes `propose_static` alike, or sets this False.)"""
    epoch = 0
    """Bumped when a `static` drafter makes its tensors anew: graphs over the old ones
    are stale (the engine keys its graphs by it)."""

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
        read: Emitted,
    ) -> None:
        pass

    def release(self, slot: int, generated: int) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass

    def report(self) -> FormReport | None:
        """What the last proposal measured (drafters with `forms`)."""
        return None

    def prepare_static(self, B: int, k: int, history: torch.Tensor, pos_host: list[int]) -> None:
        """`static` drafters, before a static step of depth k over rows 0..B-1 (at
        positions pos_host): what the step's fixed shapes cannot hold, done eagerly
        (none: nothing)."""

    def propose_static(self, batch: DraftBatch, live: torch.Tensor, keys: int) -> Proposal:
        """`static` drafters: `propose` inside the static step, over its bucket's rows
        (`live`: the rows that are not padding), attention's key axis `keys` long; no
        host read and no host state (a CUDA graph replays only the device work)."""
        raise NotImplementedError

    def after_static(self, B: int, k: int, pos_host: list[int]) -> None:
        """`static` drafters, after the step: bring the host state up to it (none: no
        host state)."""

    def warm(self) -> None:
        """Build whatever the network caches from its weights (prepacked copies) now,
        after new weights were loaded, rather than in the next proposal."""


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

    static = True
    """Proposes inside the engine's static step (`propose_static`, `engine.graphs`)."""

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
    def start(self, num_slots: int, max_len: int) -> None:
        c = self.cache
        fits = c is not None and c.num_slots >= num_slots and c.max_len >= max_len
        if fits and self.network is not None:  # the network may have been moved or cast
            w = next(self.network.parameters())
            fits = c.k.device == w.device and c.k.dtype == w.dtype
        if not fits:
            self.cache = None
            self.cache = self.new_cache(num_slots, max_len)
        S, L = self.cache.num_slots, self.cache.max_len
        self.dpos_host, self.fed_host = [0] * S, [0] * S  # dpos and fed, on the host
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
        pending = [d - f for d, f in zip(self.dpos_host[:B], self.fed_host[:B], strict=True)]
        most = max(pending, default=0)
        if most <= 0:
            return 0
        if max(self.fed_host[:B]) + most <= min(self.max_len, history.shape[1]) - 1:
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
        pairs wide (None: the most a row has, from the host mirrors); `live`: the rows
        that are not a static step's padding (they feed none), with width and max_start
        fixed by the step (`propose_static`)."""
        rows = torch.arange(lo, hi, device=self.device)
        fed = start = self.fed[lo:hi]
        pending = self.dpos[lo:hi] - fed
        if live is None:
            lag = zip(self.dpos_host[lo:hi], self.fed_host[lo:hi], strict=True)
            width = max(d - f for d, f in lag)
            max_start = max(self.fed_host[lo:hi])
        else:  # (`prepare_static` caught up every lag longer than width)
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
            self.fed_host[lo:hi] = self.dpos_host[lo:hi]

    @torch.inference_mode()
    def prefill(self, start: int, seqs: list[list[int]], hidden) -> None:
        width = max(len(q) for q in seqs) - 1
        n = len(seqs)
        long = dict(dtype=torch.long, device=self.device)
        rows = torch.arange(start, start + n, **long)
        self.fed[rows] = 0
        counts = [len(q) - 1 for q in seqs]
        self.fed_host[start : start + n] = [0] * n
        self.dpos_host[start : start + n] = counts
        counts = upload(counts, self.device)
        self._store(rows, torch.zeros(n, **long), self.features(hidden, width), counts)

    @torch.inference_mode()
    def commit(self, B, pos_before, num_new, hidden, read) -> None:
        K1 = next(iter(hidden.values())).shape[1]
        rows = torch.arange(B, device=self.device)
        feats = self.features(hidden, K1)  # [B, K1, *]
        self.dpos_host[:B] = read.pos[:B]
        if K1 > 1 or self.feats is None:
            self._store(rows, pos_before, feats, num_new)
            return
        # a plain iteration (every iteration of a rollout's large-batch head): one pair
        # per row, kept without `_store`'s mask (a row that committed none leaves a
        # feature past its `dpos`, which nothing reads before it is written again)
        self.feats[rows, pos_before.clamp(max=self.max_len)] = feats[:, 0]
        self.dpos[:B] = pos_before + num_new

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        self.catch_up(batch.last.shape[0], batch.history)
        return self._draft(batch, None)

    def prepare_static(self, B: int, k: int, history: torch.Tensor, pos_host: list[int]) -> None:
        """Before a static step of depth k: rows lagging more than the k + 1 pairs an
        iteration adds (speculation was off) catch up eagerly, so the step's feed, k + 1
        wide, holds every row's pending pairs."""
        lag = zip(self.dpos_host[:B], self.fed_host[:B], strict=True)
        if max((d - f for d, f in lag), default=0) > k + 1 or self.next_logits is None:
            self.catch_up(B, history)

    def propose_static(self, batch: DraftBatch, live: torch.Tensor, keys: int) -> Proposal:
        """`propose` over a static step's rows (`engine.graphs`), every shape fixed: the
        pending pairs fed k + 1 wide (padding rows, `live` False, feed none), then the
        k drafts; attention's key axis `keys` long. No host read, no host state: the
        host mirrors follow in `after_static`."""
        n, W = batch.last.shape[0], batch.k + 1
        self._feed(0, n, batch.history, width=W, live=live, max_start=keys - W)
        return self._draft(batch, keys - 1)

    def after_static(self, B: int, k: int, pos_host: list[int]) -> None:
        """A static step fed every pending pair of rows 0..B-1."""
        self.fed_host[:B] = self.dpos_host[:B]

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
        max_start: its key axis, fixed by a static step (None: the rows' deepest position
        plus i, from the host mirror)."""
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
        self.cache.move(src, dst, self.fed_host[src])
        for t in (self.dpos, self.fed, self.next_logits, self.next_state):
            if t is not None:
                t[dst] = t[src]
        lo, hi = self.fed_host[src], min(self.dpos_host[src], self.max_len)
        self.dpos_host[dst], self.fed_host[dst] = self.dpos_host[src], self.fed_host[src]
        if self.feats is not None and hi > lo:  # the pairs not yet fed are all a row needs
            self.feats[dst, lo:hi] = self.feats[src, lo:hi]
