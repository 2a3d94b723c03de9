"""The host's truth about the engine's rows: what each slot's request is, where it
stands and how it samples, in Python lists.

The slots' row tensors (`engine.slots`) are derived from it: copied in once per step
(`Slots.load`, `state`), read by the step and never written by it, never read back to
decide anything. The host sizes and steers every iteration from here — the deepest
position (the key axis), the draft caps, the sampling processors, the rows that
finished — and brings this state up to date once per iteration from the step's one
read (`StepRead`). Drafters keep their progress along each row here too
(`draft_pos`), so a row's host state moves with it in one place when the batch is
compacted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specroll.engine.step import StepRead

NONE, STOP, LENGTH, CONTEXT = 0, 1, 2, 3
"""Finish codes of a row (`HostRows.finish`, `StepOutputs.finish`)."""
REASONS = {STOP: "stop", LENGTH: "length", CONTEXT: "context"}
"""`Result.finish_reason` of each finish code."""
STATE = ("pos", "last", "n_gen", "left", "seed", "top_k", "max_draft")
"""The integer row state the device gets each step (`HostRows.state`), in order: the
names of `HostRows`' lists (`top_k`: of its `params`) and of `Slots`' tensors."""
STATE_F = ("temperature", "top_p")
"""The float row state the device gets each step, in order."""


class HostRows:
    """Per-slot host state of the rows being decoded (row b = slot b)."""

    def __init__(self, n: int) -> None:
        self.request = [-1] * n
        """The request each slot decodes (its index in the call)."""
        self.pos = [0] * n
        """Tokens already in each slot's cache (the position of its `last` token)."""
        self.last = [0] * n
        """Each slot's newest token (scored next, entering the cache at `pos`)."""
        self.n_gen = [0] * n
        """Tokens each slot has generated (the output index of its next token)."""
        self.finish = [NONE] * n
        """Each slot's finish code."""
        self.left = [0] * n
        """Tokens each slot may still generate (max_new - n_gen)."""
        self.seed = [0] * n
        """Each slot's seed (its request's: `spec.rng`)."""
        self.params = [(1.0, 0, 1.0)] * n
        """(temperature, top_k, top_p) of each slot (`Hints`)."""
        self.max_draft = [-1] * n
        """Each slot's draft cap (-1: none)."""
        self.draft_pos = [0] * n
        """How far along its row the drafter's own state is (its cache, the pairs it
        fed): the drafter writes it, the engine moves it with the row."""

    def lists(self) -> tuple[list, ...]:
        return (
            self.request,
            self.pos,
            self.last,
            self.n_gen,
            self.finish,
            self.left,
            self.seed,
            self.params,
            self.max_draft,
            self.draft_pos,
        )

    def admit(
        self, b: int, j: int, params: tuple[float, int, float], left: int, cap: int, seed: int
    ) -> None:
        """Slot b starts request j (its prompt comes with `prompt`)."""
        self.request[b], self.finish[b], self.params[b] = j, NONE, params
        self.left[b], self.max_draft[b], self.draft_pos[b] = left, cap, 0
        self.n_gen[b], self.seed[b] = 0, seed

    def prompt(self, b: int, ids: list[int]) -> None:
        """Slot b's prompt is in its history: its last token is scored next."""
        self.pos[b], self.last[b] = len(ids) - 1, ids[-1]

    def state(self) -> tuple[list[list[int]], list[list[float]]]:
        """Every slot's `STATE` and `STATE_F`, in their order (what `Slots.load` copies
        in)."""
        names = ("temperature", "top_k", "top_p")
        sampling = dict(zip(names, zip(*self.params, strict=True), strict=True))
        field = {**vars(self), **sampling}
        return [field[f] for f in STATE], [field[f] for f in STATE_F]

    def move(self, src: int, dst: int) -> None:
        for host in self.lists():
            host[dst] = host[src]

    def caps(self, B: int, k: int) -> list[int]:
        """Tokens each of rows 0..B-1 may draft at depth k: its request's cap
        (`max_draft`), and no more than its budget can keep (r tokens to go: r - 1
        drafts and the bonus token). `Slots.num_draft` is the same on the device."""
        return [
            min(k if m < 0 else min(m, k), left - 1)
            for m, left in zip(self.max_draft[:B], self.left[:B], strict=True)
        ]

    def advance(self, span: range, read: StepRead) -> None:
        """An iteration's emitted and kept tokens and finish codes of `span`'s slots, as
        the step's one read (`StepRead`) returned them."""
        W, tokens = read.width, read.tokens
        rows = zip(span, read.emitted, read.count, read.finish, strict=True)
        for i, (b, e, c, f) in enumerate(rows):
            self.pos[b] += e
            self.n_gen[b] += c
            self.left[b] -= c
            self.finish[b] = f
            if e:  # (a live row emits at least one token)
                self.last[b] = tokens[i * W + e - 1]

    def finished(self, B: int) -> dict[int, str]:
        """Rows among the first B that are done, with their finish reason."""
        return {b: REASONS[f] for b, f in enumerate(self.finish[:B]) if f != NONE}
