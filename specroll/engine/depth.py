"""Speculation depth: how many draft tokens per row this iteration (0 = plain decoding).

On CPUs (and on GPUs past a few hundred tokens per device) a large batch is compute
bound and verifying k+1 tokens costs close to (k+1)x, so speculation pays in small
batches — such as the long tail of a rollout — and loses in large ones. A policy sees
the live batch size (and mean context) every iteration and, after verification, what
was accepted.

* `FixedDepth`: k while the active batch is at most `max_batch`, else 0.
* `AdaptiveDepth`: each iteration the k in 0..k_max that maximises expected emitted
  tokens per second, from a fitted cost model (`specroll.sim.costmodel`) and running
  per-position acceptance estimates that follow the policy and draft as they change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FixedDepth:
    """k draft tokens while the active batch is at most `max_batch`, else plain decoding."""

    k: int = 3
    """Draft tokens per row per iteration."""
    max_batch: int = 1 << 30
    """Largest active batch that still speculates."""

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")
        if self.max_batch < 0:
            raise ValueError(f"max_batch must be >= 0, got {self.max_batch}")

    @property
    def k_max(self) -> int:
        return self.k

    def choose(self, batch_size: int, ctx: float = 0.0) -> int:
        return self.k if batch_size <= self.max_batch else 0

    def observe(self, num_draft: torch.Tensor, accepted: torch.Tensor) -> None:
        pass


@dataclass
class AdaptiveDepth:
    """argmax_k B * tau(k) / time(B, k, ctx), with tau from online acceptance estimates.

    tau(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j, where alpha_j is the probability that
    draft token j is accepted given tokens 1..j-1 were. Each alpha_j is a ratio of
    exponentially decayed counts (accepted at j / reached j) with a prior of
    `prior_weight` pseudo-drafts at `prior`. k = 0 whenever no depth beats plain decoding.

    The counts decay every iteration, drafted or not: evidence is forgotten at the same
    pace whether or not it is renewed, so estimates that a bad run pushed below the
    break-even relax towards the prior and the policy probes again (without this, a few
    early rejections at a marginal batch size switch drafting off for good — no more
    drafts, no more evidence). Where drafting clearly loses (large batches on a CPU) even
    the prior does not pay, so probing costs nothing there.
    """

    cost: object
    """A `CostModel` (target, draft and overhead times)."""
    k_max: int = 7
    """Deepest draft considered."""
    prior: float = 0.5
    """Acceptance assumed before anything is observed."""
    prior_weight: float = 4.0
    """Pseudo-count of the prior."""
    decay: float = 0.98
    """Per-iteration decay of the counts (tracks a changing policy / draft, and lets a
    pessimistic estimate relax so that drafting is probed again)."""
    reached: torch.Tensor = field(init=False, repr=False)
    accepted: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        if not 0 < self.prior < 1:
            raise ValueError(f"prior must be in (0, 1), got {self.prior}")
        self.reached = torch.zeros(self.k_max, dtype=torch.float64)
        self.accepted = torch.zeros(self.k_max, dtype=torch.float64)

    def alphas(self) -> torch.Tensor:
        """[k_max] conditional acceptance estimates."""
        w = self.prior_weight
        return (self.accepted + w * self.prior) / (self.reached + w)

    def expected_tokens(self, k: int) -> float:
        """tau(k): tokens one row emits per iteration drafting k (incl. the bonus)."""
        return 1.0 + float(torch.cumprod(self.alphas()[:k], 0).sum()) if k else 1.0

    def choose(self, batch_size: int, ctx: float = 0.0) -> int:
        self.reached *= self.decay
        self.accepted *= self.decay
        B = batch_size
        rates = [
            B * self.expected_tokens(k) / self.cost.iteration(B, k, ctx)
            for k in range(self.k_max + 1)
        ]
        return max(range(len(rates)), key=rates.__getitem__)

    def observe(self, num_draft: torch.Tensor, accepted: torch.Tensor) -> None:
        """num_draft: [B] tokens drafted per row; accepted: [B, k] per-position accept flags
        (cumulative: position j counts only if 1..j were all accepted)."""
        k = accepted.shape[1]
        if k == 0:
            return
        k = min(k, self.k_max)
        pos = torch.arange(k)
        drafted = (pos < num_draft.unsqueeze(1)).double()  # [B, k]
        acc = accepted[:, :k].double() * drafted
        # position j is *reached* when j was drafted and 0..j-1 were accepted
        prev = torch.cat([torch.ones_like(acc[:, :1]), acc[:, :-1]], dim=1)
        self.reached[:k] += (drafted * prev).sum(0)
        self.accepted[:k] += acc.sum(0)
