"""The decoding step's declared inputs and outputs.

An iteration is prepare (host) → run (device) → update (host) (`engine.iteration`). The
device function `run` sees only:

* `StepKey`: every host value it uses — shapes, the key axis, the sampling processors,
  which inputs exist. Eager, it is the iteration's own; captured (`engine.graphs`), it
  names the graph, so a step never runs with values of another shape.
* `StepInputs`: the per-iteration tensors a host-built proposal brings in (drafts, their
  q, lengths, a tree's parents, the live row count), at fixed addresses per key, beside
  the slots' own tensors (`engine.slots`).

It returns `StepOutputs`, packed into one tensor (`pack`) that the host reads back once
per iteration and decodes with `StepRead.unpack`: the only place that knows the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from specroll.drafters.base import Emitted
from specroll.spec.sampling import Hints


@dataclass(frozen=True)
class StepKey:
    """The host values of one step (module docstring)."""

    n: int
    """Rows the step runs (the live ones, or a bucket of them: `padded`)."""
    k: int
    """Draft depth, or a tree's node budget (0: plain decoding)."""
    max_start: int
    """The deepest position the key axis covers (attention's keys: max_start + k + 1)."""
    ctx: int
    """The context window: no row emits past it."""
    hints: Hints
    """The sampling processors the live rows need."""
    probs: bool = False
    """The drafts come with their q (`StepInputs.probs`)."""
    lengths: bool = False
    """Rows draft different numbers of tokens (`StepInputs.lengths`)."""
    tree: bool = False
    """The drafts are trees (`StepInputs.parents`)."""
    inside: bool = False
    """The drafter proposes inside the step, on the device (`Drafter.in_step`)."""
    padded: bool = False
    """Rows past `StepInputs.n_live` are padding (a captured step's bucket)."""
    epoch: int = -1
    """With `inside`: the age of the drafter's tensors (a new set makes a new key)."""
    echo: int = 0
    """Columns of the proposal's `echo` per row (0: none)."""


@dataclass
class StepInputs:
    """The per-iteration tensors of one key's step."""

    n_live: torch.Tensor
    """[1] rows that are live (the rest of the step's rows are padding)."""
    drafts: torch.Tensor
    """[n, k] a host-built proposal's drafts (rows past the live ones: never verified)."""
    probs: torch.Tensor | None
    """[n, k, V] their q, or None: deterministic drafts."""
    lengths: torch.Tensor | None
    """[n] usable drafts (a tree's: nodes) per row, or None: all k."""
    parents: torch.Tensor | None
    """[n, k] a tree's parents (`Proposal.parents`), or None: a chain."""
    echo: torch.Tensor | None = None
    """[n, X] what the drafter asked back of its proposal (`Proposal.echo`), or None."""

    @classmethod
    def of(cls, B: int, prop, device: torch.device) -> StepInputs:
        """An eager step's inputs: the proposal's own tensors (None: none)."""
        if prop is None:
            return cls(None, torch.zeros(B, 0, dtype=torch.long, device=device), None, None, None)
        return cls(None, prop.tokens, prop.probs, prop.lengths, prop.parents, prop.echo)

    @classmethod
    def new(cls, key: StepKey, V: int, device: torch.device) -> StepInputs:
        """Buffers for `key`'s rows and drafts over a vocabulary of V."""
        long = dict(dtype=torch.long, device=device)
        n, k = key.n, key.k
        return cls(
            torch.zeros(1, **long),
            torch.zeros(n, k, **long),
            torch.zeros(n, k, V, dtype=torch.float32, device=device) if key.probs else None,
            torch.zeros(n, **long) if key.lengths else None,  # (set for a tree: `_key`)
            torch.zeros(n, k, **long) if key.tree else None,
            torch.zeros(n, key.echo, **long) if key.echo else None,
        )

    def fill(self, B: int, prop) -> None:
        """Copy an iteration's B rows and their proposal (None: none, or made inside)
        in (device to device: queued, no sync). A tree narrower than the buffers' k (as
        wide as its fullest row) fills their first columns: its lengths keep the rest
        out of the tree."""
        self.n_live.fill_(B)
        if prop is None:
            return
        w = prop.tokens.shape[1]
        if w:
            self.drafts[:B, :w].copy_(prop.tokens)
        if prop.probs is not None:
            self.probs[:B].copy_(prop.probs)
        if prop.parents is not None:
            self.parents[:B, :w].copy_(prop.parents)
        if prop.echo is not None:
            self.echo[:B].copy_(prop.echo)
        if prop.lengths is not None:
            self.lengths[:B].copy_(prop.lengths)
        elif self.lengths is not None:
            self.lengths[:B].fill_(w)


@dataclass
class StepOutputs:
    """What the host learns of an iteration, on the device (n rows, K drafts each)."""

    emitted: torch.Tensor
    """[n] tokens that entered each row's cache: accepted drafts, then the one drawn."""
    count: torch.Tensor
    """[n] of those, the tokens kept as output (cut at a stop, the budget, the window)."""
    finish: torch.Tensor
    """[n] each row's finish code (`engine.rows`)."""
    drafted: torch.Tensor
    """[n] drafts each row had verified."""
    accepted: torch.Tensor
    """[n] of those, accepted."""
    nodes: torch.Tensor
    """[n] tree nodes each row had verified (0 for a chain)."""
    tokens: torch.Tensor
    """[n, K+1] each row's verified candidates."""
    echo: torch.Tensor | None = None
    """[n, X] the proposal's `echo` (None: none), handed back to the drafter."""
    accepted_at: torch.Tensor | None = None
    """[K] rows whose draft at position i was accepted (None: K = 0)."""
    drafted_at: torch.Tensor | None = None
    """[K] rows that drafted position i."""
    learned: torch.Tensor | None = None
    """What the depth policy learns: [K] a chain's rows that drafted and kept position
    i; [k] a tree's rows whose accepted path went through node i + 1."""

    def pack(self) -> torch.Tensor:
        """Every field, flat, in declaration order (absent ones left out): the one
        tensor the host reads."""
        parts = [getattr(self, f.name) for f in fields(self)]
        return torch.cat([p.flatten() for p in parts if p is not None])


class Ran(NamedTuple):
    """What the device function returns (the same tensors every replay when captured)."""

    packed: torch.Tensor
    """`StepOutputs.pack`: the one tensor the host reads."""
    emitted: torch.Tensor
    """[n] `StepOutputs.emitted`, left on the device for the drafter's commit."""
    hidden: dict[int, torch.Tensor]
    """The drafter's hidden states of the target forward (`Drafter.hidden_layers`)."""
    width: int
    """K + 1: the candidates per row."""


ROW_FIELDS = [f.name for f in fields(StepOutputs)].index("tokens")
"""`StepOutputs`' fields of one value per row: those before `tokens`."""


@dataclass
class StepRead:
    """`StepOutputs` on the host, for the first B of its n rows (the live ones)."""

    emitted: list[int]
    count: list[int]
    finish: list[int]
    drafted: list[int]
    accepted: list[int]
    nodes: list[int]
    tokens: list[int]
    """Each row's K + 1 candidates, flat."""
    width: int
    """K + 1."""
    echo: list[list[int]] | None
    """Each row's `StepOutputs.echo` (None: none)."""
    accepted_at: list[int]
    drafted_at: list[int]
    learned: list[int]

    @classmethod
    def unpack(cls, host: list[int], n: int, B: int, width: int, echo: int = 0) -> StepRead:
        """Decode `StepOutputs.pack` read back as `host`, for n rows of `width`
        candidates and `echo` columns of echo (K = width - 1 per-position fields when
        K > 0)."""
        R = ROW_FIELDS
        rows = [host[i * n : i * n + B] for i in range(R)]
        at = R * n + n * width
        echoed = [host[at + b * echo : at + (b + 1) * echo] for b in range(B)] if echo else None
        at, K = at + n * echo, width - 1
        per = [host[at : at + K], host[at + K : at + 2 * K], host[at + 2 * K :]]
        tokens = host[R * n : R * n + B * width]
        return cls(*rows, tokens, width, echoed, *(per if K else [[]] * 3))

    def for_drafter(self, pos: list[int]) -> Emitted:
        """What a drafter learns of the iteration (rows at positions `pos` after it)."""
        return Emitted(pos, self.emitted, self.count, self.tokens, self.width, self.echo)
