"""Predicted acceptance of a drafter of deterministic candidates, without a forward.

A sampled response is a draw y ~ p at every position, and tree verification descends
exactly when the draw is a candidate (`spec.tree`). So walking the drafter's trees along
responses that plain decoding sampled gives the tokens per iteration that the engine
would realise on those samples, in distribution, at no model cost: the estimate behind
the history drafter's design, and the prediction its engine runs are checked against.

The walk runs the drafter through the engine's own hooks (prefill, propose, commit,
release) in the engine's iteration order — all requests decoding side by side, each
advancing by what it accepted plus one — so sources that depend on concurrency (live
siblings) see what they would see in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from specroll.drafters.base import DraftBatch, Drafter, Emitted
from specroll.spec.sampling import RowSampling


@dataclass
class Walk:
    """Iterations and tokens of a walk (the engine's row_forwards / emitted_tokens)."""

    row_forwards: int = 0
    """Row-iterations after the first token (each verifies one tree)."""
    emitted: int = 0
    """Tokens those iterations emitted."""
    drafted: int = 0
    """Row-iterations that proposed at least one candidate."""
    accepted: int = 0
    """Candidates accepted."""
    nodes: int = 0
    """Candidates proposed (what the target would score)."""

    def __add__(self, other: Walk) -> Walk:
        """Two walks' counts together (e.g. one walk per GRPO group)."""
        return Walk(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Walk)))

    @property
    def tokens_per_target_forward(self) -> float:
        return self.emitted / self.row_forwards if self.row_forwards else 0.0

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafted if self.drafted else 1.0


def walk(
    drafter: Drafter,
    prompts: list[list[int]],
    responses: list[list[int]],
    k: int,
    max_new_tokens: int | list[int],
) -> Walk:
    """Walk `drafter` (node budget k per iteration) along `responses` to `prompts`, all
    decoding side by side as in one engine batch; max_new_tokens: each request's budget
    (one for all, or one per request), which bounds its draft depth as in the engine."""
    B = len(prompts)
    budget = [max_new_tokens] * B if isinstance(max_new_tokens, int) else list(max_new_tokens)
    L = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True)) + k + 2
    history = torch.zeros(B, L, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        history[b, : len(p) + len(r)] = torch.tensor(p + r)
    drafter.start(B, L)
    drafter.prefill(0, [p + r[:1] for p, r in zip(prompts, responses, strict=True)], {})
    n_gen = [1] * B  # the first token comes from the prefill
    rows = list(range(B))  # slot -> response index; finished rows are compacted away
    out = Walk()
    for slot in reversed(range(B)):  # responses of one token are done at once
        if len(responses[rows[slot]]) <= 1:
            rows = _release(drafter, rows, slot, len(responses[rows[slot]]))
    while rows:
        n = len(rows)
        g = torch.tensor([n_gen[j] for j in rows])
        pos_host = [len(prompts[j]) - 1 + n_gen[j] for j in rows]
        caps = [max(min(k, budget[j] - n_gen[j] - 1), 0) for j in rows]
        pos, cap = torch.tensor(pos_host), torch.tensor(caps)
        prop = drafter.propose(
            DraftBatch(
                k=k,
                num_draft=cap,
                last=history[rows].gather(1, pos.unsqueeze(1)).squeeze(1),
                pos=pos,
                history=history[rows],
                sampling=RowSampling.full(n, 1.0),
                seed=torch.zeros(n, dtype=torch.long),
                n_gen=g,
                pos_host=pos_host,
                caps=caps,
            )
        )
        num, new = [], []
        for slot, j in enumerate(rows):
            r, at = responses[j], n_gen[j]
            a = _descend(prop, slot, r[at:], int(cap[slot]))
            emitted = min(a + 1, len(r) - at)
            n_gen[j] += emitted
            num.append(emitted)
            new.append(r[at : at + emitted])
            out.row_forwards += 1
            out.emitted += emitted
            out.nodes += k if prop.lengths is None else int(prop.lengths[slot])
            if _proposed(prop, slot):
                out.drafted += 1
                out.accepted += a
        width = max(len(x) for x in new)
        flat = [t for x in new for t in x + [0] * (width - len(x))]
        after = [p + e for p, e in zip(pos_host, num, strict=True)]
        drafter.commit(n, pos, torch.tensor(num), {}, Emitted(after, num, num, flat, width))
        for slot in reversed(range(n)):
            if n_gen[rows[slot]] >= len(responses[rows[slot]]):
                rows = _release(drafter, rows, slot, len(responses[rows[slot]]))
    return out


def _proposed(prop, slot: int) -> bool:
    return prop.lengths is None or int(prop.lengths[slot]) > 0


def _descend(prop, slot: int, ahead: list[int], cap: int) -> int:
    """How deep the row's tree follows the response's next tokens (`ahead`)."""
    k = prop.tokens.shape[1]
    n = k if prop.lengths is None else int(prop.lengths[slot])
    tokens = prop.tokens[slot, :n].tolist()
    parents = (
        list(range(n)) if prop.parents is None else prop.parents[slot, :n].tolist()
    )  # a chain: draft j hangs under node j
    node, depth = 0, 0
    while depth < min(cap, len(ahead)):
        y = ahead[depth]
        child = next((j + 1 for j in range(n) if parents[j] == node and tokens[j] == y), None)
        if child is None:
            break
        node, depth = child, depth + 1
    return depth


def _release(drafter: Drafter, rows: list[int], slot: int, generated: int) -> list[int]:
    """Finish the row in `slot` and compact as the engine does (the last row moves in)."""
    drafter.release(slot, generated)
    last = len(rows) - 1
    if slot != last:
        drafter.move(last, slot)
        rows[slot] = rows[last]
    return rows[:last]
