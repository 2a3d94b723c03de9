"""The interface between the engine and a drafter.

A drafter only *proposes*: the engine decides how many tokens each row may draft, runs the
target over them, and `spec.verify` decides what is accepted. A drafter never sees the
acceptance uniforms; drafters that sample draw from their own RNG stream (`rng.DRAFT`)
and must return the exact processed distribution `q` they sampled from.

Per generate() call the engine calls, in order:
  start(num_slots, max_len, rows)      fresh state for a new batch of requests; rows: the
                                       engine's host state of its rows (`RowState`)
  prefill(start, seqs, hidden)         rows start.. were just admitted: seqs[r] = prompt +
                                       the first generated token; hidden = target states
                                       over the prompt positions
  prepare(B, k, history, captured)     before an iteration whose proposal an `in_step`
                                       drafter makes inside the engine's step: on the
                                       host, what the step's shapes cannot hold
  propose(batch) -> Proposal           once per speculative iteration (k >= 1): on the
                                       host before the step, or (`in_step`) on the device
                                       inside it; a drafter with `forms` makes the one
                                       batch.form names
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

Host reads: the engine reads the device back once per iteration, after it (`Emitted`,
with whatever the proposal asked back: `Proposal.echo`), and hands drafters what the
host knows (`DraftBatch.pos_host`, `.caps`, `Emitted`), so that a drafter needs no read
of its own: on a GPU each read is a stall of the stream
(`engine.syncs`). A drafter that builds tensors from host lists copies them in with
`device.upload` (pinned, non-blocking).

Devices and dtypes: a drafter works on the device of the tensors the engine hands it
(its network's, which the engine's model shares) and makes its own state there; a draft
network runs in its weights' dtype (the engine's), and the q it returns is fp32, the
exact distribution its tokens were sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from specroll.spec.sampling import RowSampling


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
    """`pos` as the host already knows it (the engine's `HostRows`), so that a drafter need
    not read it back from the device; None: unknown."""
    caps: list[int] | None = None
    """`num_draft` as the host knows it; None: unknown."""
    form: str | None = None
    """Which of its `Drafter.forms` a drafter that has several makes (`engine.forms`);
    None: its first."""
    live: torch.Tensor | None = None
    """[B] inside a captured step: the rows that are not padding (None: all are live)."""
    keys: int | None = None
    """Inside a captured step: attention's key axis, fixed (None: the rows' own, from
    `pos_host`)."""

    @property
    def max_pos(self) -> int | None:
        """max(pos) as the host knows it (None: unknown)."""
        return None if self.pos_host is None else max(self.pos_host, default=0)


class RowState(Protocol):
    """The engine's host state of its rows (`engine.rows.HostRows`), as a drafter sees
    it: one truth, so a drafter keeps no copy of its own."""

    pos: list[int]
    """Tokens in each slot's target cache."""
    draft_pos: list[int]
    """How far along each slot's row the drafter's own state is: the drafter's to write
    (the engine moves it with the row)."""


class OwnRows:
    """A `RowState` for a drafter run without an engine (`engine.walk`)."""

    def __init__(self, n: int) -> None:
        self.pos, self.draft_pos = [0] * n, [0] * n


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
    echo: list[list[int]] | None = None
    """Each row's `Proposal.echo`, as the step's read brought it (None: none)."""

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
    echo: torch.Tensor | None = None
    """[B, X] (long) what the drafter wants back of its proposal, read with the step's
    outputs (`Emitted.echo`): what it made on the device and learns from after the
    step, without a read of its own. None: nothing."""


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
    in_step = False
    """Proposes on the device alone, so inside the engine's step (`engine.iteration`;
    captured with CUDA graphs on): `propose` then reads no host value but the batch's
    shapes when `DraftBatch.keys` is set, and bumps `epoch` whenever it makes its
    tensors anew."""
    epoch = 0
    """Bumped when an `in_step` drafter makes its tensors anew: steps captured over the
    old ones are stale (the engine keys its captured steps by it)."""
    rows: RowState | None = None
    """The engine's host state of the rows (`start`)."""

    def start(self, num_slots: int, max_len: int, rows: RowState | None = None) -> None:
        self.rows = rows if rows is not None else OwnRows(num_slots)

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

    def prepare(self, B: int, k: int, history: torch.Tensor, captured: bool) -> None:
        """`in_step` drafters, before a step of depth k over rows 0..B-1 whose proposal is
        made inside it (`captured`: a step of fixed shapes): on the host, what those
        shapes cannot hold (none: nothing)."""

    def warm(self) -> None:
        """Build whatever the network caches from its weights (prepacked copies) now,
        after new weights were loaded, rather than in the next proposal."""
