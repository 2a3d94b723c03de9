"""Speculation depth: how many draft tokens per row this iteration (0 = plain decoding).

On CPUs (and on GPUs past a few hundred tokens per device) a large batch is compute
bound and verifying k+1 tokens costs close to (k+1)x, so speculation pays in small
batches — such as the long tail of a rollout — and loses in large ones. A policy sees
the live batch size (and mean context) every iteration and, after verification, what
was accepted.

* `DepthPolicy`: what the engine calls — per decode/verify iteration `choose(B, ctx)`,
  then `observe_counts(rows, accepted, tokens)` after verification (when it drafted)
  and `observe_time(B, k, ctx, seconds)` with the iteration's wall time; `k_max` sizes
  the engine's buffers. For a drafter that can fill a budget in several forms, the
  policy's `forms` (`engine.forms.FormChoice`) chooses the form once the budget is set:
  one decision, on one objective (tokens per second), by one policy.
* `FixedDepth`: k while the active batch is at most `max_batch`, else 0.
* `AdaptiveDepth`: each iteration the k in 0..k_max that maximises expected emitted
  tokens per second, from the acceptance estimate (`engine.acceptance`) and the fitted
  cost model (`engine.costmodel`) calibrated online on the iteration times the engine
  measures (`engine.calibration`). With `tree=True` (a drafter of trees) k is a node
  budget: adaptive tree size.

This module is the chooser only: the two estimates it weighs live in their own modules
so that each is read (and tested) on its own, and the exploration rules below — the one
place that decides — read both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from specroll.engine.acceptance import PRIOR, AcceptanceEstimate, octave
from specroll.engine.calibration import TimeCalibration
from specroll.engine.costmodel import COST_FIELDS
from specroll.engine.forms import FormChoice

REFRESH = 64
"""Iterations at a batch octave after which an alternative's time is measured again."""
PROBE_MARGIN = 0.9
"""While decoding plainly, re-try the best depth only if predicted at least this
fraction of plain decoding's tokens/s."""
MARGIN = 0.02
"""Predicted gain a depth needs over plain decoding to be chosen: the estimates err
towards optimism (a prior above what most drafters keep, relaxed towards; a tail shrunk
towards a head that accepts more), and a choice within a few percent of plain decoding
gains nothing measurable when right and loses when wrong."""
QUIET = 8
"""Iterations at a batch octave that keep plain decoding without re-deciding, once every
depth is predicted below PROBE_MARGIN^2 of its tokens/s (the large-batch head of a
rollout: deciding costs ~0.1 ms of Python per iteration, on a GPU ~1 %)."""


class DepthPolicy(Protocol):
    """What the engine asks of a depth policy (module docstring)."""

    forms: FormChoice
    """How a chosen budget is filled, for a drafter with several forms (`engine.forms`)."""

    @property
    def k_max(self) -> int:
        """Deepest draft (largest node budget) `choose` may return."""
        ...

    def choose(self, batch_size: int, ctx: float = 0.0) -> int:
        """Draft tokens (tree nodes) per row this iteration; 0 = plain decoding."""
        ...

    def observe_counts(self, rows: int, accepted: list[int], tokens: int | None = None) -> None:
        """After verification: per position (node), the rows that accepted it."""
        ...

    def observe_time(self, batch_size: int, k: int, ctx: float, seconds: float) -> None:
        """The iteration's wall time."""
        ...


@dataclass
class FixedDepth:
    """k draft tokens while the active batch is at most `max_batch`, else plain decoding."""

    k: int = 3
    """Draft tokens per row per iteration."""
    max_batch: int = 1 << 30
    """Largest active batch that still speculates."""
    forms: FormChoice = field(default_factory=FormChoice, init=False, repr=False, compare=False)
    """How the budget is filled (`engine.forms`; drafters with several forms)."""

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

    def observe_counts(self, rows: int, accepted: list[int], tokens: int | None = None) -> None:
        self.forms.counted(rows, accepted)

    def observe_time(self, batch_size: int, k: int, ctx: float, seconds: float) -> None:
        pass


@dataclass
class AdaptiveDepth:
    """argmax_k B * tau(k) / time(B, k, ctx), with tau from online acceptance estimates
    (`engine.acceptance`: per position, per batch octave, decayed, relaxed towards the
    prior while plain) and time from the cost model corrected by the iteration times
    actually measured (`engine.calibration`). k = 0 whenever no depth beats plain
    decoding by `MARGIN`.

    **Trees** (`tree=True`). k counts the nodes of a draft tree, which a tree drafter
    proposes best first with parents before children (`drafters.candidate_tree`): a
    budget of m keeps the first m nodes of the budget-k tree. The walk descends into a
    child exactly when the target's draw is that child, so under a budget of m it would
    have stopped at the first node of the accepted path numbered m or more, with the
    same draw: one verified tree tells what every smaller budget would have emitted.
    Hence tau(k) = 1 + sum_{i<k} a_i (see `engine.acceptance`). The budgets considered
    are 0, 1, 2, 4, ... (and k_max); probing steps up one of them.

    **Exploration** is deterministic and cheap: before speculating at a batch octave
    where plain decoding has not run (or not in the last `REFRESH` iterations there),
    run one plain iteration; go at most one deeper than the deepest depth run at the
    octave (the first probe of a large batch costs 2x a plain iteration, not 8x; where
    speculation pays, the steps up pay too); while decoding plainly, step towards the
    best depth once at each octave whatever the profile predicts (a profile that
    overrates drafting costs must not switch speculation off for good), then every
    `REFRESH` iterations only if it is predicted within `PROBE_MARGIN` of plain
    decoding; likewise, the depths next to the chosen one are measured every `REFRESH`
    iterations when predicted within `PROBE_MARGIN` of it; where every depth is
    predicted below `PROBE_MARGIN`^2 of plain decoding, the octave stays plain for
    `QUIET` iterations without deciding again. `best` is the choice without exploration.
    Nothing is random, and depth choices never change the distribution of the samples
    (verification is exact). Where drafting clearly loses (large batches on a CPU) even
    the prior does not pay, so probing costs nothing there.

    The tunables are module constants (here, `engine.acceptance`, `engine.calibration`):
    no setting reaches them, and the tests hold the behaviour they buy.
    """

    cost: object
    """A `CostModel` (target, draft and overhead times)."""
    k_max: int = 7
    """Deepest draft considered."""
    tree: bool = False
    """k is a tree's node budget (a tree drafter): see **Trees**."""
    forms: FormChoice = field(default_factory=FormChoice, init=False, repr=False)
    """How a chosen budget is filled (`engine.forms`; drafters with several forms)."""
    sizes: list[int] = field(init=False, repr=False)
    """The depths (node budgets) considered."""

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        self.acceptance = AcceptanceEstimate(self.k_max, self.tree, PRIOR)
        self.calibrated = TimeCalibration(self.cost, self.k_max, self.tree)
        self._seen: dict[tuple[int, int], int] = {}  # (octave, k) -> octave iteration
        self._iters: dict[int, int] = {}  # octave -> iterations chosen there
        self._quiet: dict[int, int] = {}  # octave -> iteration until which it stays plain
        self.sizes = list(range(self.k_max + 1))
        if self.tree:
            grid = {0, self.k_max, *(1 << i for i in range(self.k_max.bit_length()))}
            self.sizes = sorted(s for s in grid if s <= self.k_max)

    def state_dict(self) -> dict:
        """What it learnt during a run — the cost model it started from (a quick profile
        is measured anew by each process), the acceptance counts, the time calibration
        and the exploration's clocks — as plain lists and numbers, for a checkpoint: a
        resumed run chooses depths as the interrupted one would have."""
        cost = {f: getattr(self.cost, f) for f in COST_FIELDS if hasattr(self.cost, f)}
        return {
            "cost": cost,
            "acceptance": self.acceptance.state_dict(),
            "calibration": self.calibrated.state_dict(),
            "seen": [[b, k, it] for (b, k), it in self._seen.items()],
            "iters": [[b, it] for b, it in self._iters.items()],
            "quiet": [[b, it] for b, it in self._quiet.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`."""
        for f, v in state["cost"].items():
            if f in COST_FIELDS:
                setattr(self.cost, f, float(v))
        self.acceptance.load_state_dict(state["acceptance"])
        self.calibrated.load_state_dict(state["calibration"])
        self._seen = {(int(b), int(k)): int(it) for b, k, it in state["seen"]}
        self._iters = {int(b): int(it) for b, it in state["iters"]}
        self._quiet = {int(b): int(it) for b, it in state["quiet"]}

    # ------------------------------------------------------------------ acceptance

    @property
    def reached(self) -> torch.Tensor:
        """[k_max] decayed count of rows that reached each draft position (all octaves)."""
        return torch.tensor(self.acceptance.totals()[0], dtype=torch.float64, device="cpu")

    @property
    def accepted(self) -> torch.Tensor:
        """[k_max] decayed count of rows whose draft was accepted at each position."""
        return torch.tensor(self.acceptance.totals()[1], dtype=torch.float64, device="cpu")

    def shrinkage(self) -> float:
        """Pseudo-drafts by which an octave's estimates are shrunk towards the pooled
        ones (`AcceptanceEstimate.shrinkage`)."""
        return self.acceptance.shrinkage()

    def alphas(self, batch_size: int | None = None) -> torch.Tensor:
        """[k_max] conditional acceptance estimates (trees: node i on the accepted path)
        at a batch size's octave (None: pooled over every octave)."""
        b = None if batch_size is None else octave(batch_size)
        return torch.tensor(self.acceptance.alphas(b), dtype=torch.float64, device="cpu")

    def expected_tokens(self, k: int, batch_size: int | None = None) -> float:
        """tau(k): tokens one row emits per iteration drafting k (incl. the bonus), at a
        batch size's octave (None: pooled)."""
        b = None if batch_size is None else octave(batch_size)
        return self.acceptance.taus(b)[min(k, self.k_max)]

    def observe(self, num_draft: torch.Tensor, accepted: torch.Tensor) -> None:
        """num_draft: [B] tokens drafted per row; accepted: [B, k] per-position accept flags
        (cumulative: position j counts only if 1..j were all accepted)."""
        k = min(accepted.shape[1], self.k_max)
        if k == 0:
            return
        drafted = torch.arange(k, device=num_draft.device) < num_draft.unsqueeze(1)  # [B, k]
        self.observe_counts(accepted.shape[0], (accepted[:, :k] & drafted).sum(0).tolist())

    def observe_counts(self, rows: int, accepted: list[int], tokens: int | None = None) -> None:
        """`observe` from host values (`AcceptanceEstimate.observe_counts`; and the
        forms' small budgets, `FormChoice.counted`)."""
        self.acceptance.observe_counts(rows, accepted, tokens)
        self.forms.counted(rows, accepted)

    # ------------------------------------------------------------------ time

    @staticmethod
    def octave(batch_size: int) -> int:
        """Batch-size bucket: 1 | 2-3 | 4-7 | 8-15 | ..."""
        return octave(batch_size)

    @property
    def disagreement(self) -> dict | None:
        """Set when the profile failed its check: the median ratios that failed it."""
        return self.calibrated.disagreement

    def observe_time(self, batch_size: int, k: int, ctx: float, seconds: float) -> None:
        """Wall time of one engine iteration over `batch_size` rows drafting k."""
        if self.calibrated.observe(batch_size, k, ctx, seconds):
            b = octave(batch_size)
            self._seen[b, k] = self._iters.get(b, 0)

    def corrections(self, batch_size: int) -> list[float]:
        """[k_max + 1] log(measured / predicted) time ratios used at this batch size."""
        corr = self.calibrated.corrections(octave(batch_size), range(self.k_max + 1))
        return [corr[k] for k in range(self.k_max + 1)]

    def times(self, batch_size: int, ctx: float = 0.0) -> list[float]:
        """[k_max + 1] expected seconds of an iteration at each depth
        (`TimeCalibration.times`)."""
        t = self.calibrated.times(batch_size, ctx, range(self.k_max + 1))
        return [t[k] for k in range(self.k_max + 1)]

    def calibration(self) -> dict:
        """Median measured/predicted time ratio per batch octave and depth (for reports)."""
        return self.calibrated.report()

    # ------------------------------------------------------------------ choice

    def rates(self, batch_size: int, ctx: float = 0.0) -> list[float]:
        """[k_max + 1] expected emitted tokens per second at each depth."""
        r = self._rates(batch_size, ctx, range(self.k_max + 1))
        return [r[k] for k in range(self.k_max + 1)]

    def _rates(self, B: int, ctx: float, ks) -> dict[int, float]:
        taus = self.acceptance.taus(octave(B))
        times = self.calibrated.times(B, ctx, ks)
        return {k: B * taus[k] / max(t, 1e-12) for k, t in times.items()}

    def _margined(self, B: int, ctx: float) -> dict[int, float]:
        """The considered depths' rates, plain decoding's raised by `MARGIN`: drafting
        must beat it by that much to be chosen."""
        rates = self._rates(B, ctx, self.sizes)
        rates[0] *= 1 + MARGIN
        return rates

    def best(self, batch_size: int, ctx: float = 0.0) -> int:
        """The depth with the highest expected tokens/s, plain decoding's raised by
        `MARGIN` (no exploration)."""
        rates = self._margined(batch_size, ctx)
        return max(self.sizes, key=rates.__getitem__)

    def _next(self, k: int, step: int) -> int | None:
        """The considered depth `step` places above (+) or below (-) k, if any."""
        i = self.sizes.index(k) + step if k in self.sizes else -1
        return self.sizes[i] if 0 <= i < len(self.sizes) else None

    def choose(self, batch_size: int, ctx: float = 0.0) -> int:
        """`best`, with the exploration of **Exploration**."""
        self.acceptance.relax_later()  # pessimistic estimates relax (applied when read)
        b = octave(batch_size)
        it = self._iters[b] = self._iters.get(b, 0) + 1
        if it < self._quiet.get(b, 0):
            return 0
        rates = self._margined(batch_size, ctx)
        best = max(self.sizes, key=rates.__getitem__)
        top = max((j for j in self.sizes[1:] if self.calibrated.measured(b, j)), default=0)
        deeper = self._next(top, 1)  # one step deeper than measured here

        def due(k: int) -> bool:  # never run at this octave, or not for REFRESH iterations
            seen = self._seen.get((b, k))
            return seen is None or it - seen > REFRESH

        close = PROBE_MARGIN * rates[best]
        if best == 0:
            alt = max(self.sizes[1:], key=rates.__getitem__)
            step = min(alt, deeper if deeper is not None else alt)
            if due(step) and (top == 0 or rates[alt] >= close):
                return step  # once per octave whatever the profile says; then only if close
            if top and rates[alt] < PROBE_MARGIN * close:  # far from paying: stay
                self._quiet[b] = it + QUIET  # plain without re-deciding for a while
            return 0
        if due(0):  # plain decoding measured first (and now and then)
            return 0
        if best > top and deeper is not None:  # one step deeper than measured here
            return deeper
        for n in (self._next(best, 1), self._next(best, -1)):  # neighbours predicted close:
            if n and due(n) and rates[n] >= close:  # measure them now and then
                return n
        return best
