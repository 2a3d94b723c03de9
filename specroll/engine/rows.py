"""The host's truth about the engine's rows: what each slot's request is, where it
stands and how it samples, in Python lists.

The slots' tensors (`engine.slots`) are the device's copy of the same rows; the host
never reads them to decide anything. It sizes and steers every iteration from here —
the deepest position (the key axis), the draft caps, the sampling processors, the rows
that finished — and brings this state up to date once per iteration from the step's one
read (`StepRead`). Drafters keep their progress along each row here too
(`draft_pos`), so a row's host state moves with it in one place when the batch is
compacted.
"""

from __future__ import annotations

NONE, STOP, LENGTH, CONTEXT = 0, 1, 2, 3
"""Finish codes of a row (`Slots.finish`, `HostRows.finish`)."""
REASONS = {STOP: "stop", LENGTH: "length", CONTEXT: "context"}
"""`Result.finish_reason` of each finish code."""


class HostRows:
    """Per-slot host state of the rows being decoded (row b = slot b)."""

    def __init__(self, n: int) -> None:
        self.request = [-1] * n
        """The request each slot decodes (its index in the call)."""
        self.pos = [0] * n
        """Tokens already in each slot's cache (the position of its `last` token)."""
        self.finish = [NONE] * n
        """Each slot's finish code."""
        self.left = [0] * n
        """Tokens each slot may still generate (max_new - n_gen)."""
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
            self.finish,
            self.left,
            self.params,
            self.max_draft,
            self.draft_pos,
        )

    def admit(self, b: int, j: int, params: tuple[float, int, float], left: int, cap: int) -> None:
        """Slot b starts request j."""
        self.request[b], self.finish[b], self.params[b] = j, NONE, params
        self.left[b], self.max_draft[b], self.draft_pos[b] = left, cap, 0

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

    def advance(self, span: range, emitted: list[int], count: list[int], finish: list[int]) -> None:
        """An iteration's emitted and kept tokens and finish codes of `span`'s slots, as
        the step's one read returned them."""
        for b, e, c, f in zip(span, emitted, count, finish, strict=True):
            self.pos[b] += e
            self.left[b] -= c
            self.finish[b] = f

    def finished(self, B: int) -> dict[int, str]:
        """Rows among the first B that are done, with their finish reason."""
        return {b: REASONS[f] for b, f in enumerate(self.finish[:B]) if f != NONE}
