"""Speculation depth: how many draft tokens per row this iteration (0 = plain decoding).

On CPUs (and on GPUs past a few hundred tokens per device) a large batch is compute
bound and verifying k+1 tokens costs close to (k+1)x, so speculation pays in small
batches — such as the long tail of a rollout — and loses in large ones. A policy sees
the live batch size (and mean context) every iteration and, after verification, what
was accepted.

* `FixedDepth`: k while the active batch is at most `max_batch`, else 0.
* `AdaptiveDepth`: each iteration the k in 0..k_max that maximises expected emitted
  tokens per second, from a fitted cost model (`specroll.sim.costmodel`) calibrated
  online on the iteration times the engine measures, and running per-position
  acceptance estimates that follow the policy and draft as they change. With
  `tree=True` (a drafter of trees) k is a node budget: adaptive tree size.

The engine calls, per decode/verify iteration, `choose(B, ctx)`, then `observe(num_draft,
accepted)` after verification (when it drafted) and `observe_time(B, k, ctx, seconds)`
with the iteration's wall time.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import deque
from dataclasses import dataclass, field

import torch


def _median(xs) -> float:
    """statistics.median of a short sequence, without its overhead (every iteration)."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


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

    def observe_counts(self, rows: int, accepted: list[int], tokens: int | None = None) -> None:
        pass

    def observe_time(self, batch_size: int, k: int, ctx: float, seconds: float) -> None:
        pass


@dataclass
class AdaptiveDepth:
    """argmax_k B * tau(k) / time(B, k, ctx), with tau from online acceptance estimates and
    time from the cost model corrected by the iteration times actually measured.

    **Acceptance.** tau(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j, where alpha_j is the
    probability that draft token j is accepted given tokens 1..j-1 were. Each alpha_j is
    a ratio of exponentially decayed counts (accepted at j / reached j) with a prior of
    `prior_weight` pseudo-drafts at `prior`. A position the drafter left empty (an n-gram
    without a match, a per-request cap) counts as reached and rejected: the target
    verified that column anyway, so it is what k buys. k = 0 whenever no depth beats
    plain decoding. Tokens verified and then cut (what follows a stop token the drafter
    predicted: short answers, whose ends the history predicts well) are measured per
    octave and taken off tau(k >= 1): they cost a draft's time and emit nothing.

    Acceptance is estimated per batch octave too: an octave's counts, shrunk by
    `octave_weight` pseudo-drafts towards the pooled estimate (every octave's counts,
    shrunk towards the prior). The rows left in a rollout's tail, where drafting pays,
    are its longest answers, which a drafter may predict worse than the average row
    (history especially); so the tail is judged on what the tail accepted once it has a
    tail's worth of evidence, and on the pooled estimate before (a handful of rows at
    one batch size is noise: the octaves would only add variance where acceptance does
    not depend on the batch size). How far is itself estimated (empirical Bayes): the
    variance between the octaves' true rates of a first draft, by moments — their
    measured rates' spread less what binomial noise explains — sets the shrinkage to
    the pseudo-count of a beta prior of that variance around the pooled rate, between
    `min_octave_weight` and `octave_weight`. Where the octaves agree it stays at
    `octave_weight`; where the tail's rows are clearly harder than the head's (history
    early in a run: a third of the first drafts accepted at batch 16, a tenth at 1–3),
    a tail's few dozen drafts outweigh the large batches' probes.

    The counts decay with every drafting iteration (tracking a changing policy and
    draft), and an estimate below the prior also decays, by `relax`, with every plain
    one: estimates that a bad run pushed below the break-even relax towards the prior
    and the policy probes again (without this, a few early rejections at a marginal
    batch size switch drafting off for good — no more drafts, no more evidence). The
    relaxation is slow next to a rollout's large-batch head (a few hundred plain
    iterations), so the next tail starts from what the last one measured rather than
    from the prior: relaxing as fast as the counts decay would hand every tail the
    prior's optimism, and a drafter whose acceptance is below the prior would draft at
    a loss until the tail had measured it again. Where drafting clearly loses (large
    batches on a CPU) even the prior does not pay, so probing costs nothing there.

    **Time.** A profile can be wrong by any factor (measured on a busy machine, another
    thread count, stale), and a wrong one alone would keep the policy in a losing k. So
    every iteration's wall time is compared with the profile's prediction, and the ratio
    measured / predicted is kept per (k, batch-size octave) as the median of its last
    `window` iterations; time(B, k, ctx) = profile(B, k, ctx) x that ratio. Once plain
    decoding and a depth have both run at a batch size, the choice between them rests
    on measured times (the profile only interpolates within an octave and across
    contexts); a depth not yet run there borrows its ratio from depths run there
    (interpolated in k; beyond the deepest one measured, not more optimistic than it or
    than the nearest octave's, shrunk by `borrow` per octave, unless the measured times'
    slope in k says it is cheaper: see `times`).

    **Trees** (`tree=True`). k counts the nodes of a draft tree, which a tree drafter
    proposes best first with parents before children (`drafters.history`,
    `drafters.combined`): a budget of m keeps the first m nodes of the budget-k tree. The
    walk descends into a child exactly when the target's draw is that child, so under a
    budget of m it would have stopped at the first node of the accepted path numbered m
    or more, with the same draw: one verified tree tells what every smaller budget would
    have emitted. Hence tau(k) = 1 + sum_{i<k} a_i, where a_i (the rate at which node i
    was on the accepted path) is estimated from decayed counts, a node the proposal left
    empty counting as reached and missed, with the prior a_i = prior / (i + 1). The
    budgets considered are 0, 1, 2, 4, ... (and k_max); probing steps up one of them.

    Exploration is deterministic and cheap: before speculating at a batch octave where
    plain decoding has not run (or not in the last `refresh` iterations there), run one
    plain iteration; go at most one deeper than the deepest depth run at the octave (the
    first probe of a large batch costs 2x a plain iteration, not 8x; where speculation
    pays, the steps up pay too); while decoding plainly, step towards the best depth once
    at each octave whatever the profile predicts (a profile that overrates drafting costs
    must not switch speculation off for good), then every `refresh` iterations only if it
    is predicted within `probe_margin` of plain decoding; likewise, the depths next to
    the chosen one are measured every `refresh` iterations when predicted within
    `probe_margin` of it; where every depth is predicted below `probe_margin`^2 of plain
    decoding, the octave stays plain for `quiet` iterations without deciding again.
    `best` is the choice without exploration. Nothing is random, and
    depth choices never change the distribution of the samples (verification is exact).

    **Stale profiles.** After its first `check_after` iterations the policy compares the
    profile with the measurements (median ratio overall and per k); outside `stale_band`
    it warns and calls the cost model's `mark_stale` (a cached profile is then measured
    again by the next run; see `specroll.engine.profile.cached_profile`). The online
    correction keeps the current run safe in the meantime.
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
    """Decay of the counts per drafting iteration (tracks a changing policy / draft)."""
    octave_weight: float = 64.0
    """Most pseudo-drafts by which a batch octave's acceptance estimate is shrunk towards
    the pooled one (a handful of rows at one batch size is noise, a tail's worth is not);
    fewer where the octaves' measured rates disagree beyond noise (see **Acceptance**)."""
    min_octave_weight: float = 4.0
    """Fewest pseudo-drafts of that shrinkage, however much the octaves disagree."""
    relax: float = 0.998
    """Decay per plain iteration of the counts of estimates below the prior (so that
    drafting is probed again; ~0.7 / (1 - relax) plain iterations forget half); a tree's
    node i relaxes at relax^(1 / (i + 1))."""
    window: int = 16
    """Measured/predicted time ratios kept per (k, batch octave); their median is used."""
    refresh: int = 64
    """Iterations at a batch octave after which an alternative's time is measured again."""
    probe_margin: float = 0.9
    """While decoding plainly, re-try the best depth only if predicted at least this
    fraction of plain decoding's tokens/s."""
    margin: float = 0.02
    """Predicted gain a depth needs over plain decoding to be chosen: the estimates err
    towards optimism (a prior above what most drafters keep, relaxed towards; a tail
    shrunk towards a head that accepts more), and a choice within a few percent of plain
    decoding gains nothing measurable when right and loses when wrong."""
    quiet: int = 8
    """Iterations at a batch octave that keep plain decoding without re-deciding, once
    every depth is predicted below probe_margin^2 of its tokens/s (the large-batch head
    of a rollout: deciding costs ~0.1 ms of Python per iteration, on a GPU ~1 %)."""
    borrow: float = 0.5
    """Weight per octave of distance of a time ratio borrowed from another batch octave."""
    check_after: int = 48
    """Iterations after which the profile is checked against the measurements."""
    stale_band: tuple[float, float] = (0.67, 1.5)
    """Median measured/predicted ratios outside this band mark the profile stale."""
    disagreement: dict | None = field(init=False, default=None, repr=False)
    """Set when the profile failed its check: the median ratios that failed it."""
    tree: bool = False
    """k is a tree's node budget (a tree drafter): see **Trees**."""

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        if not 0 < self.prior < 1:
            raise ValueError(f"prior must be in (0, 1), got {self.prior}")
        if not 0 < self.min_octave_weight <= self.octave_weight:
            raise ValueError(
                "min_octave_weight must be in (0, octave_weight], got "
                f"{self.min_octave_weight} (octave_weight {self.octave_weight})"
            )
        for name in ("decay", "relax"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.window < 1 or self.refresh < 1:
            raise ValueError(f"window and refresh must be >= 1, got {self.window}, {self.refresh}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")
        if self.quiet < 0:
            raise ValueError(f"quiet must be >= 0, got {self.quiet}")
        # batch octave -> decayed (reached, accepted) per draft position (Python floats:
        # this runs every iteration)
        self._counts: dict[int, tuple[list[float], list[float]]] = {}
        self._pool = ([0.0] * self.k_max, [0.0] * self.k_max)  # their sums, kept in step
        self._ratios: dict[tuple[int, int], deque] = {}  # (octave, k) -> measured/predicted
        self._logr: dict[tuple[int, int], float] = {}  # (octave, k) -> log median of those
        self._seen: dict[tuple[int, int], int] = {}  # (octave, k) -> octave iteration
        self._iters: dict[int, int] = {}  # octave -> iterations chosen there
        self._quiet: dict[int, int] = {}  # octave -> iteration until which it stays plain
        self._relaxing = 0  # plain-iteration relaxations not yet applied (`_settle`)
        self._waste: dict[int, list[float]] = {}  # octave -> decayed (tokens lost, rows)
        self._first: list[tuple[int, float]] = []  # (k, ratio) of the first iterations
        self._checked = False
        self.sizes = list(range(self.k_max + 1))
        """The depths (node budgets) considered."""
        self._prior = [self.prior] * self.k_max  # per-position prior estimate
        if self.tree:
            grid = {0, self.k_max, *(1 << i for i in range(self.k_max.bit_length()))}
            self.sizes = sorted(s for s in grid if s <= self.k_max)
            self._prior = [self.prior / (i + 1) for i in range(self.k_max)]

    # ------------------------------------------------------------------ acceptance

    def _totals(self) -> tuple[list[float], list[float]]:
        """Decayed (reached, accepted) per position, summed over the octaves (kept in step
        with them rather than summed per call: this runs every iteration)."""
        self._settle()
        return self._pool

    def _settle(self) -> None:
        """Apply the relaxations of the plain iterations since the counts were last read.
        n of them at once are relax^n: relaxing moves an estimate below the prior towards
        it, never past it, so the positions relaxed stay the same throughout."""
        n, self._relaxing = self._relaxing, 0
        if n:
            self._decay(below_prior=True, times=n)

    @property
    def reached(self) -> torch.Tensor:
        """[k_max] decayed count of rows that reached each draft position (all octaves)."""
        return torch.tensor(self._totals()[0], dtype=torch.float64, device="cpu")

    @property
    def accepted(self) -> torch.Tensor:
        """[k_max] decayed count of rows whose draft was accepted at each position."""
        return torch.tensor(self._totals()[1], dtype=torch.float64, device="cpu")

    def shrinkage(self) -> float:
        """Pseudo-drafts by which an octave's estimates are shrunk towards the pooled ones:
        the beta prior around the pooled rate of a first draft whose variance is the
        octaves' between-octave variance (method of moments, counts as sample sizes)."""
        w_max = self.octave_weight
        self._settle()
        own = [(r[0], a[0] / r[0]) for r, a in self._counts.values() if r[0] > 0]
        if len(own) < 2:
            return w_max
        n = sum(r for r, _ in own)
        p = sum(r * x for r, x in own) / n
        noise = p * (1 - p)  # a rate's variance times its sample size
        spread = sum(r * (x - p) ** 2 for r, x in own) - (len(own) - 1) * noise
        between = spread / (n - sum(r * r for r, _ in own) / n)
        if between <= noise / (w_max + 1):
            return w_max
        return max(self.min_octave_weight, noise / between - 1)

    def _alphas(self, octave: int | None = None) -> list[float]:
        """Estimates at `octave`: its own counts shrunk towards the pooled estimate (None:
        the pooled estimate, every octave's counts shrunk towards the prior)."""
        w = self.prior_weight
        reached, accepted = self._totals()
        pooled = [
            (a + w * p) / (r + w) for a, r, p in zip(accepted, reached, self._prior, strict=True)
        ]
        own = self._counts.get(octave) if octave is not None else None
        if own is None:
            return pooled
        w = self.shrinkage()
        return [(a + w * p) / (r + w) for r, a, p in zip(*own, pooled, strict=True)]

    def alphas(self, batch_size: int | None = None) -> torch.Tensor:
        """[k_max] conditional acceptance estimates (trees: node i on the accepted path)
        at a batch size's octave (None: pooled over every octave)."""
        octave = None if batch_size is None else self.octave(batch_size)
        return torch.tensor(self._alphas(octave), dtype=torch.float64, device="cpu")

    def _taus(self, octave: int | None = None) -> list[float]:
        taus, run = [1.0], 1.0
        lost = self._lost(octave)
        for a in self._alphas(octave):
            run = a if self.tree else run * a
            taus.append(taus[-1] + run)
        return [taus[0], *(max(t - lost, 1.0) for t in taus[1:])]

    def _lost(self, octave: int | None) -> float:
        """Tokens per row a drafting iteration verifies and then discards: drafts and
        the bonus token past a stop token (a drafter that predicts how answers end — the
        history — has its stop token accepted, and what follows it is cut). Decayed per
        drafting iteration like the counts; with `prior_weight` pseudo-rows of none."""
        w = self._waste.get(octave) if octave is not None else None
        if w is None:
            w = [sum(x[0] for x in self._waste.values()), sum(x[1] for x in self._waste.values())]
        return w[0] / (w[1] + self.prior_weight)

    def expected_tokens(self, k: int, batch_size: int | None = None) -> float:
        """tau(k): tokens one row emits per iteration drafting k (incl. the bonus), at a
        batch size's octave (None: pooled)."""
        octave = None if batch_size is None else self.octave(batch_size)
        return self._taus(octave)[min(k, self.k_max)]

    def _decay(self, below_prior: bool, times: int = 1) -> None:
        """Decay the counts of positions whose pooled estimate is below (`below_prior`, by
        `relax`: a plain iteration) or not below the prior (by `decay`: a drafting one),
        `times` times."""
        factor = (self.relax if below_prior else self.decay) ** times
        if factor == 1.0:
            return
        # a tree's node i relaxes i + 1 times slower (as its prior weighs): the budget
        # that re-measures it costs ~(i + 1)x more, and a relaxed deep node would bring
        # back the prior's optimism for a big tree (32 nodes: 2 tokens), which a row
        # drafting alone pays ~2.6 plain iterations to measure again
        slow = self.tree and below_prior
        # on the pooled estimate: every octave's counts of a position decay alike, so
        # their sum decays as one pooled count would
        for j, a in enumerate(self._alphas()):
            if (a < self._prior[j]) == below_prior:
                f = factor ** (1 / (j + 1)) if slow else factor
                for reached, accepted in (self._pool, *self._counts.values()):
                    reached[j] *= f
                    accepted[j] *= f

    def observe(self, num_draft: torch.Tensor, accepted: torch.Tensor) -> None:
        """num_draft: [B] tokens drafted per row; accepted: [B, k] per-position accept flags
        (cumulative: position j counts only if 1..j were all accepted)."""
        k = min(accepted.shape[1], self.k_max)
        if k == 0:
            return
        drafted = torch.arange(k, device=num_draft.device) < num_draft.unsqueeze(1)  # [B, k]
        self.observe_counts(accepted.shape[0], (accepted[:, :k] & drafted).sum(0).tolist())

    def observe_counts(self, rows: int, accepted: list[int], tokens: int | None = None) -> None:
        """`observe` from host values: rows verified (the batch size, whose octave the
        counts go to), and per position j the rows whose drafts 0..j were all accepted
        (and drafted); trees: per node j, the rows whose accepted path went through it.
        `tokens`: what the rows recorded (None: every accepted draft and bonus token)."""
        k = min(len(accepted), self.k_max)
        if k == 0:
            return
        acc = accepted[:k]
        self._decay(below_prior=False)  # the others relax in choose() (`_settle`)
        b = self.octave(rows)
        waste = self._waste.setdefault(b, [0.0, 0.0])  # decayed (tokens lost, rows)
        waste[0] *= self.decay
        waste[1] = waste[1] * self.decay + rows
        if tokens is not None:
            waste[0] += max(rows + sum(accepted) - tokens, 0)
        # position j is *reached* when 0..j-1 were accepted (drafted or not: an empty
        # position was verified all the same, and rejected); a tree's every node is
        reached = [rows] * k if self.tree else [rows, *acc[:-1]]
        if b not in self._counts:
            self._counts[b] = ([0.0] * self.k_max, [0.0] * self.k_max)
        counts_r, counts_a = self._counts[b]
        pool_r, pool_a = self._pool
        for j in range(k):
            counts_r[j] += reached[j]
            counts_a[j] += acc[j]
            pool_r[j] += reached[j]
            pool_a[j] += acc[j]

    # ------------------------------------------------------------------ time

    def _predict(self, B: int, k: int, ctx: float) -> float:
        """The profile's iteration time (a tree's k nodes cost more than k drafts)."""
        if self.tree:
            return self.cost.iteration(B, k, ctx, tree=True)
        return self.cost.iteration(B, k, ctx)

    @staticmethod
    def octave(batch_size: int) -> int:
        """Batch-size bucket: 1 | 2-3 | 4-7 | 8-15 | ..."""
        return max(int(batch_size), 1).bit_length() - 1

    def observe_time(self, batch_size: int, k: int, ctx: float, seconds: float) -> None:
        """Wall time of one engine iteration over `batch_size` rows drafting k."""
        pred = self._predict(batch_size, k, ctx)
        if pred <= 0 or seconds <= 0 or not 0 <= k <= self.k_max:
            return
        key = (self.octave(batch_size), k)
        ratios = self._ratios.get(key)
        if ratios is None:
            ratios = self._ratios[key] = deque(maxlen=self.window)
        ratios.append(seconds / pred)
        self._logr[key] = math.log(_median(ratios))
        self._seen[key] = self._iters.get(key[0], 0)
        if not self._checked:
            self._first.append((k, seconds / pred))
            if len(self._first) >= self.check_after:
                self._check_profile()

    def _check_profile(self) -> None:
        self._checked = True
        lo, hi = self.stale_band
        groups = {"all": [r for _, r in self._first]}
        for k in sorted({k for k, _ in self._first}):
            rs = [r for kk, r in self._first if kk == k]
            if len(rs) >= 4:
                groups[f"k={k}"] = rs
        medians = {g: round(statistics.median(rs), 3) for g, rs in groups.items()}
        bad = {g: m for g, m in medians.items() if not lo <= m <= hi}
        if not bad:
            return
        self.disagreement = medians
        where = self.cost.meta.get("cache_path", "") if hasattr(self.cost, "meta") else ""
        mark = getattr(self.cost, "mark_stale", None)
        reason = (
            f"measured / predicted iteration time over the first {len(self._first)} "
            f"iterations: {medians} (outside [{lo}, {hi}])"
        )
        if mark is not None:
            mark(reason)
        warnings.warn(
            f"the hardware profile disagrees with this run's iteration times: {reason}; "
            "adaptive depth corrects it online"
            + (f"; {where} will be measured again by the next run" if where else ""),
            RuntimeWarning,
            stacklevel=3,
        )

    def _relative(self, b: int) -> list[float | None] | None:
        """[k_max + 1] log(ratio at k / ratio at 0) in octave b from its own measurements,
        interpolated in k between measured depths, None beyond the deepest; None without
        plain decoding and a depth measured there."""
        logr = self._logr
        e0 = logr.get((b, 0))
        if e0 is None:
            return None
        known = [(j, logr[b, j] - e0) for j in range(self.k_max + 1) if (b, j) in logr]
        if len(known) < 2:
            return None
        out: list[float | None] = [None] * (self.k_max + 1)
        for (lo, dlo), (hi, dhi) in zip(known, known[1:], strict=False):
            for k in range(lo, hi + 1):
                out[k] = dlo + (dhi - dlo) * (k - lo) / (hi - lo)
        return out

    def corrections(self, batch_size: int) -> list[float]:
        """[k_max + 1] log(measured / predicted) time ratios used at this batch size."""
        corr = self._corrections(self.octave(batch_size), range(self.k_max + 1))
        return [corr[k] for k in range(self.k_max + 1)]

    def _corrections(self, b: int, ks) -> dict[int, float]:
        """`corrections` at octave b, for the depths ks only (the policy's hot path)."""
        logr = self._logr
        own = {k: logr.get((b, k)) for k in ks}
        if all(v is not None for v in own.values()):
            return own
        octaves = sorted({o for o, _ in logr}, key=lambda o: (abs(o - b), o))
        e0 = next((logr[o, 0] for o in octaves if (o, 0) in logr), 0.0)
        rel = self._relative(b)
        deepest = None  # relative ratio of the deepest depth measured here
        if rel is not None:
            deepest = next(v for v in reversed(rel) if v is not None)
        other = next(  # the nearest other octave with plain and a depth measured
            ((o, r) for o in octaves if o != b and (r := self._relative(o)) is not None),
            None,
        )
        out = {}
        for k in ks:
            if own[k] is not None:
                out[k] = own[k]
                continue
            if rel is not None and rel[k] is not None:
                out[k] = e0 + rel[k]
                continue
            cands = [] if deepest is None else [deepest]
            if other is not None:
                o, r = other
                v = r[k] if r[k] is not None else next(x for x in reversed(r) if x is not None)
                cands.append(v * self.borrow ** abs(o - b))
            # beyond the deepest depth measured here: not more optimistic than it
            out[k] = e0 + (max(cands) if cands else 0.0)
        return out

    def times(self, batch_size: int, ctx: float = 0.0) -> list[float]:
        """[k_max + 1] expected seconds of an iteration at each depth: the profile times
        its measured correction. Beyond the deepest depth measured at this octave, the
        lower of two extrapolations: the deepest one's ratio (the profile's shape) and
        the measured times' slope over the two deepest (a profile whose per-depth cost is
        wrong has the wrong shape; being optimistic there costs one probe, one step
        deeper, which then measures it)."""
        t = self._times(batch_size, ctx, range(self.k_max + 1))
        return [t[k] for k in range(self.k_max + 1)]

    def _times(self, B: int, ctx: float, ks) -> dict[int, float]:
        """`times` for the depths ks only (the policy's hot path: a tree of 32 nodes is
        choosing among 7 budgets, not 33)."""
        b = self.octave(B)
        measured = sorted(k for o, k in self._logr if o == b)
        slope_from = measured[-2:] if len(measured) >= 2 and measured[0] == 0 else []
        need = sorted({*ks, *slope_from})
        corr = self._corrections(b, need)
        t = {k: self._predict(B, k, ctx) * math.exp(corr[k]) for k in need}
        if slope_from:
            k1, k2 = slope_from
            slope = max(t[k2] - t[k1], 0.0) / (k2 - k1)
            for k in ks:
                if k > k2:
                    t[k] = min(t[k], t[k2] + slope * (k - k2))
        return t

    def rates(self, batch_size: int, ctx: float = 0.0) -> list[float]:
        """[k_max + 1] expected emitted tokens per second at each depth."""
        r = self._rates(batch_size, ctx, range(self.k_max + 1))
        return [r[k] for k in range(self.k_max + 1)]

    def _rates(self, B: int, ctx: float, ks) -> dict[int, float]:
        taus = self._taus(self.octave(B))
        return {k: B * taus[k] / max(t, 1e-12) for k, t in self._times(B, ctx, ks).items()}

    def _margined(self, B: int, ctx: float) -> dict[int, float]:
        """The considered depths' rates, plain decoding's raised by `margin`: drafting
        must beat it by that much to be chosen."""
        rates = self._rates(B, ctx, self.sizes)
        rates[0] *= 1 + self.margin
        return rates

    def best(self, batch_size: int, ctx: float = 0.0) -> int:
        """The depth with the highest expected tokens/s, plain decoding's raised by
        `margin` (no exploration)."""
        rates = self._margined(batch_size, ctx)
        return max(self.sizes, key=rates.__getitem__)

    def _next(self, k: int, step: int) -> int | None:
        """The considered depth `step` places above (+) or below (-) k, if any."""
        i = self.sizes.index(k) + step if k in self.sizes else -1
        return self.sizes[i] if 0 <= i < len(self.sizes) else None

    def choose(self, batch_size: int, ctx: float = 0.0) -> int:
        self._relaxing += 1  # pessimistic estimates relax (applied when read: `_settle`)
        b = self.octave(batch_size)
        it = self._iters[b] = self._iters.get(b, 0) + 1
        if it < self._quiet.get(b, 0):
            return 0
        rates = self._margined(batch_size, ctx)
        best = max(self.sizes, key=rates.__getitem__)
        top = max((j for j in self.sizes[1:] if (b, j) in self._logr), default=0)
        deeper = self._next(top, 1)  # one step deeper than measured here

        def due(k: int) -> bool:  # never run at this octave, or not for `refresh` iterations
            seen = self._seen.get((b, k))
            return seen is None or it - seen > self.refresh

        close = self.probe_margin * rates[best]
        if best == 0:
            alt = max(self.sizes[1:], key=rates.__getitem__)
            step = min(alt, deeper if deeper is not None else alt)
            if due(step) and (top == 0 or rates[alt] >= close):
                return step  # once per octave whatever the profile says; then only if close
            if top and rates[alt] < self.probe_margin * close:  # far from paying: stay
                self._quiet[b] = it + self.quiet  # plain without re-deciding for a while
            return 0
        if due(0):  # plain decoding measured first (and now and then)
            return 0
        if best > top and deeper is not None:  # one step deeper than measured here
            return deeper
        for n in (self._next(best, 1), self._next(best, -1)):  # neighbours predicted close:
            if n and due(n) and rates[n] >= close:  # measure them now and then
                return n
        return best

    def calibration(self) -> dict:
        """Median measured/predicted time ratio per batch octave and depth (for reports)."""
        out: dict[str, dict[int, float]] = {}
        for (b, k), r in sorted(self._logr.items()):
            out.setdefault(f"B{1 << b}-{(2 << b) - 1}", {})[k] = round(math.exp(r), 3)
        return out
