"""Speculative-decoding statistics, named as vLLM and EAGLE report them.

* acceptance length (AL, τ) = 1 + accepted / drafts — includes the bonus/recovered token;
* acceptance rate = accepted / draft tokens;
* per-position acceptance i = drafts whose first i+1 tokens were all accepted / drafts
  that proposed at least i+1 tokens (cumulative, like vLLM's counters);
* tokens per target forward = emitted tokens / row-forwards (per row: 1 for plain
  decoding, at most k+1 with speculation).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

_ADDITIVE = (
    "drafts",
    "draft_tokens",
    "accepted_tokens",
    "target_forwards",
    "row_forwards",
    "emitted_tokens",
    "prompts_reused",
    "draft_nodes",
    "draft_s",
    "target_s",
    "graphs",
    "capture_s",
    "graph_bytes",
    "graph_failures",
)
"""SpecStats scalars that add up across engines running side by side."""


@dataclass
class SpecStats:
    """Counters of one generate() call (or of a request, or of an RL step)."""

    drafts: int = 0
    """Row-iterations that verified at least one draft token."""
    draft_tokens: int = 0
    """Draft tokens verified."""
    accepted_tokens: int = 0
    """Draft tokens accepted."""
    accepted_per_pos: list[int] = field(default_factory=list)
    """[i] drafts whose tokens 0..i were all accepted."""
    drafted_per_pos: list[int] = field(default_factory=list)
    """[i] drafts that proposed at least i+1 tokens."""
    depth_hist: list[int] = field(default_factory=list)
    """[k] decode/verification forwards that drafted k tokens per row (0 = plain)."""
    target_forwards: int = 0
    """Decode/verification forwards of the target (prefill excluded)."""
    row_forwards: int = 0
    """Rows scored by those forwards (a forward over B rows counts B)."""
    emitted_tokens: int = 0
    """Tokens emitted by those forwards."""
    draft_nodes: int = 0
    """Candidate tokens scored by those forwards (a chain's equal its draft tokens; a
    tree's count every node, where draft_tokens counts its depth)."""
    node_hits: list[int] = field(default_factory=list)
    """Trees: [i] row-iterations whose accepted path went through node i + 1."""
    node_rows: list[int] = field(default_factory=list)
    """Trees: [i] row-iterations verified with a budget of more than i nodes."""
    draft_s: float = 0.0
    """Wall time in the drafter (propose + commit)."""
    target_s: float = 0.0
    """Wall time in target forwards (prefill included)."""
    prompts_reused: int = 0
    """Rows whose prompt an earlier row of the call had prefilled: copied, not computed
    (`engine.prompt_reuse`; GRPO's groups)."""
    total_s: float = 0.0
    """Wall time of the whole generate() call."""
    graphs: int = 0
    """CUDA graphs of the decoding step captured in the call (`engine.graphs`)."""
    capture_s: float = 0.0
    """Wall time spent capturing them."""
    graph_bytes: int = 0
    """Device memory their shared pool took."""
    graph_failures: int = 0
    """Step shapes whose capture failed (they run eagerly; `Engine.captured.failed`)."""

    def observe(self, num_draft: torch.Tensor, accepted: torch.Tensor, emitted: int) -> None:
        """num_draft: [B]; accepted: [B, K] cumulative acceptance mask; emitted: tokens out."""
        K = accepted.shape[1]
        col = torch.arange(K, device=num_draft.device)  # [K]
        drafted = (col < num_draft.unsqueeze(1)).sum(dim=0).tolist()
        self.observe_counts(
            num_draft.shape[0], K, emitted, num_draft.tolist(), accepted.sum(0).tolist(), drafted
        )

    def observe_counts(
        self,
        rows: int,
        k: int,
        emitted: int,
        num_draft: list[int],
        accepted_per_pos: list[int],
        drafted_per_pos: list[int],
    ) -> None:
        """`observe` from host values (what the engine reads back once per iteration):
        rows scored, draft depth k, tokens emitted, each row's draft length, and per
        position the rows that had it accepted and the rows that drafted it."""
        self.target_forwards += 1
        self.row_forwards += rows
        self.emitted_tokens += emitted
        while len(self.depth_hist) <= k:
            self.depth_hist.append(0)
        self.depth_hist[k] += 1
        if k == 0 or not any(d > 0 for d in num_draft):
            return
        while len(self.accepted_per_pos) < k:
            self.accepted_per_pos.append(0)
            self.drafted_per_pos.append(0)
        self.drafts += sum(d > 0 for d in num_draft)
        self.draft_tokens += sum(num_draft)
        self.accepted_tokens += sum(accepted_per_pos)
        for i in range(k):
            self.accepted_per_pos[i] += accepted_per_pos[i]
            self.drafted_per_pos[i] += drafted_per_pos[i]

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def per_position(self) -> list[float]:
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_per_pos, self.drafted_per_pos, strict=True)
        ]

    @property
    def tokens_per_target_forward(self) -> float:
        """Tokens a row gains per target forward (1 for plain decoding, k+1 at best)."""
        return self.emitted_tokens / self.row_forwards if self.row_forwards else 0.0

    @property
    def other_s(self) -> float:
        return max(self.total_s - self.draft_s - self.target_s, 0.0)

    def observe_tree(self, rows: int, hits: list[int]) -> None:
        """A verified tree iteration: rows, and per node the rows whose path took it."""
        for mine in (self.node_hits, self.node_rows):
            mine.extend([0] * (len(hits) - len(mine)))
        for i, h in enumerate(hits):
            self.node_hits[i] += h
            self.node_rows[i] += rows

    def tau_at(self, m: int) -> float:
        """Tokens per row-iteration a budget of m would have emitted: trees, from the
        nodes' hits (a tree drafter proposes best first, parents first, so a budget of m
        keeps nodes 1..m and the walk with the same draw stops at the first node past
        them: exact for every m up to the budget verified); chains, 1 + the sum of the
        first m per-position acceptances (the first m tests are the same)."""
        if self.node_rows:
            pairs = zip(self.node_hits[:m], self.node_rows[:m], strict=True)
            return 1.0 + sum(h / r for h, r in pairs if r)
        return 1.0 + sum(self.per_position[:m])

    @staticmethod
    def merged(parts: list[SpecStats]) -> SpecStats:
        """Counters of several engines that ran side by side (e.g. Ray rollout workers):
        counts and busy times add up; the wall time is the slowest engine's."""
        out = SpecStats()
        for p in parts:
            for name in _ADDITIVE:
                setattr(out, name, getattr(out, name) + getattr(p, name))
            out.total_s = max(out.total_s, p.total_s)
            for mine, theirs in (
                (out.accepted_per_pos, p.accepted_per_pos),
                (out.drafted_per_pos, p.drafted_per_pos),
                (out.depth_hist, p.depth_hist),
                (out.node_hits, p.node_hits),
                (out.node_rows, p.node_rows),
            ):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v
        return out

    def summary(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "draft_nodes": self.draft_nodes,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_length": round(self.acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "per_position": [round(x, 4) for x in self.per_position],
            "target_forwards": self.target_forwards,
            "depth_hist": list(self.depth_hist),
            "tokens_per_target_forward": round(self.tokens_per_target_forward, 4),
            "draft_s": round(self.draft_s, 4),
            "target_s": round(self.target_s, 4),
            "prompts_reused": self.prompts_reused,
            "other_s": round(self.other_s, 4),
            "total_s": round(self.total_s, 4),
        }


class CollapseDetector:
    """Flags a drafter whose acceptance over the last `window` observations is tiny (the
    engine feeds it drafts and first-token acceptances).

    A silently stale or corrupted draft is the most common bug class in peer systems; it
    costs speed, not correctness, so it is reported rather than raised.
    """

    def __init__(self, window: int = 256, threshold: float = 0.02) -> None:
        self.window, self.threshold = window, threshold
        self.events: deque[tuple[int, int]] = deque()
        self.drafted = self.accepted = 0

    def observe(self, drafted: int, accepted: int) -> bool:
        """Add one iteration; True when the window is full and below the threshold."""
        if drafted == 0:
            return False
        self.events.append((drafted, accepted))
        self.drafted += drafted
        self.accepted += accepted
        while self.events and self.drafted - self.events[0][0] >= self.window:
            d, a = self.events.popleft()
            self.drafted -= d
            self.accepted -= a
        return self.drafted >= self.window and self.accepted < self.threshold * self.drafted
