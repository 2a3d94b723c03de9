"""The engine's per-row state, slot-indexed tensors (row b = cache slot b), so that a
decoding step is a handful of tensor ops whatever the batch size."""

from __future__ import annotations

import torch

NONE, STOP, LENGTH, CONTEXT = 0, 1, 2, 3
"""Finish codes of a row (`Slots.finish`)."""


class Slots:
    """Slot-indexed state of the rows being decoded (row b = slot b)."""

    def __init__(self, n: int, max_gen: int, max_stops: int, max_len: int, k_max: int) -> None:
        long = dict(dtype=torch.long)
        self.pos = torch.zeros(n, **long)  # tokens already in the cache
        self.last = torch.zeros(n, **long)  # newest token, not yet in the cache
        self.n_gen = torch.zeros(n, **long)
        self.max_new = torch.zeros(n, **long)
        self.seed = torch.zeros(n, **long)
        self.temperature = torch.zeros(n)
        self.top_k = torch.zeros(n, **long)
        self.top_p = torch.ones(n)
        self.max_draft = torch.full((n,), -1, **long)
        self.stops = torch.full((n, max(max_stops, 1)), -1, **long)
        self.tokens = torch.zeros(n, max_gen, **long)  # [S, max_gen]
        self.logprobs = torch.zeros(n, max_gen)  # [S, max_gen]
        self.history = torch.zeros(n, max_len, **long)  # [S, L] prompt + generated ids
        self.finish = torch.zeros(n, **long)  # NONE / STOP / LENGTH / CONTEXT
        self.drafts = torch.zeros(n, **long)  # per-request speculation counters
        self.draft_tokens = torch.zeros(n, **long)
        self.accepted = torch.zeros(n, **long)
        self.accepted_pos = torch.zeros(n, max(k_max, 1), **long)  # [S, k_max]
        self.drafted_pos = torch.zeros(n, max(k_max, 1), **long)
        self.request = [-1] * n

    def tensors(self) -> list[torch.Tensor]:
        return [v for v in vars(self).values() if isinstance(v, torch.Tensor)]

    def move(self, src: int, dst: int) -> None:
        for t in self.tensors():
            t[dst] = t[src]
        self.request[dst] = self.request[src]
