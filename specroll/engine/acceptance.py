"""Acceptance estimate: what one more draft token (or tree node) is worth, per batch size.

The adaptive depth policy (`engine.depth`) weighs expected emitted tokens against time;
this module holds the first half, from the per-position counts the engine reports after
verification. It is kept apart from the time calibration (`engine.calibration`) because
the two learn from different evidence at different moments — acceptance only from
drafting iterations, time from every iteration — and each is tested on its own.

**Chains.** tau(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j, where alpha_j is the probability
that draft token j is accepted given tokens 1..j-1 were. Each alpha_j is a ratio of
exponentially decayed counts (accepted at j / reached j) with a prior of `PRIOR_WEIGHT`
pseudo-drafts at the prior. A position the drafter left empty (an n-gram without a
match, a per-request cap) counts as reached and rejected: the target verified that
column anyway, so it is what k buys. Tokens verified and then cut (what follows a stop
token the drafter predicted: short answers, whose ends the history predicts well) are
measured per octave and taken off tau(k >= 1): they cost a draft's time and emit nothing.

**Trees.** tau(k) = 1 + sum_{i<k} a_i, where a_i (the rate at which node i was on the
accepted path) is estimated alike, a node the proposal left empty counting as reached
and missed, with the prior a_i = prior / (i + 1) (see `engine.depth`, **Trees**).

**Batch octaves.** Acceptance is estimated per batch octave too: an octave's counts,
shrunk by up to `OCTAVE_WEIGHT` pseudo-drafts towards the pooled estimate (every
octave's counts, shrunk towards the prior). The rows left in a rollout's tail, where
drafting pays, are its longest answers, which a drafter may predict worse than the
average row (history especially); so the tail is judged on what the tail accepted once
it has a tail's worth of evidence, and on the pooled estimate before. How far is itself
estimated (empirical Bayes, `shrinkage`): the variance between the octaves' true rates
of a first draft, by moments — their measured rates' spread less what binomial noise
explains — sets the shrinkage to the pseudo-count of a beta prior of that variance
around the pooled rate, between `MIN_OCTAVE_WEIGHT` and `OCTAVE_WEIGHT`.

**Forgetting.** The counts decay by `DECAY` with every drafting iteration (tracking a
changing policy and draft), and an estimate below the prior also decays, by `RELAX`,
with every plain one: estimates that a bad run pushed below the break-even relax towards
the prior and the policy probes again (without this, a few early rejections at a
marginal batch size switch drafting off for good). The relaxation is slow next to a
rollout's large-batch head, so the next tail starts from what the last one measured
rather than from the prior.
"""

from __future__ import annotations

PRIOR = 0.5
"""Acceptance assumed before anything is observed."""
PRIOR_WEIGHT = 4.0
"""Pseudo-count of the prior."""
DECAY = 0.98
"""Decay of the counts per drafting iteration (tracks a changing policy / draft)."""
OCTAVE_WEIGHT = 64.0
"""Most pseudo-drafts by which a batch octave's acceptance estimate is shrunk towards
the pooled one (a handful of rows at one batch size is noise, a tail's worth is not);
fewer where the octaves' measured rates disagree beyond noise."""
MIN_OCTAVE_WEIGHT = 4.0
"""Fewest pseudo-drafts of that shrinkage, however much the octaves disagree."""
RELAX = 0.998
"""Decay per plain iteration of the counts of estimates below the prior (so that
drafting is probed again; ~0.7 / (1 - RELAX) plain iterations forget half); a tree's
node i relaxes at RELAX^(1 / (i + 1))."""


def octave(batch_size: int) -> int:
    """Batch-size bucket: 1 | 2-3 | 4-7 | 8-15 | ..."""
    return max(int(batch_size), 1).bit_length() - 1


class AcceptanceEstimate:
    """Decayed per-position (per-node) acceptance counts per batch octave (module
    docstring). Python floats throughout: this runs every iteration."""

    def __init__(self, k_max: int, tree: bool, prior: float = PRIOR) -> None:
        self.k_max, self.tree = k_max, tree
        # batch octave -> decayed (reached, accepted) per draft position
        self._counts: dict[int, tuple[list[float], list[float]]] = {}
        self._pool = ([0.0] * k_max, [0.0] * k_max)  # their sums, kept in step
        self._relaxing = 0  # plain-iteration relaxations not yet applied (`_settle`)
        self._waste: dict[int, list[float]] = {}  # octave -> decayed (tokens lost, rows)
        self._prior = [prior / (i + 1) if tree else prior for i in range(k_max)]

    def state_dict(self) -> dict:
        """The counts as plain lists (a checkpoint: a resumed run estimates as the
        interrupted one would have)."""
        return {
            "counts": [[b, list(r), list(a)] for b, (r, a) in self._counts.items()],
            "pool": [list(x) for x in self._pool],
            "relaxing": self._relaxing,
            "waste": [[b, *w] for b, w in self._waste.items()],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict` (of an estimate with the same k_max and shape)."""
        k = self.k_max
        counts = {
            int(b): ([float(x) for x in r], [float(x) for x in a]) for b, r, a in state["counts"]
        }
        if any(len(r) != k or len(a) != k for r, a in counts.values()):
            raise ValueError(f"acceptance state: not {k} positions per octave")
        self._counts = counts
        self._pool = tuple([float(x) for x in v] for v in state["pool"])  # type: ignore[assignment]
        self._relaxing = int(state["relaxing"])
        self._waste = {int(b): [float(x), float(n)] for b, x, n in state["waste"]}

    def totals(self) -> tuple[list[float], list[float]]:
        """Decayed (reached, accepted) per position, summed over the octaves (kept in step
        with them rather than summed per call: this runs every iteration)."""
        self._settle()
        return self._pool

    def relax_later(self) -> None:
        """A plain iteration's relaxation, applied when the counts are next read."""
        self._relaxing += 1

    def _settle(self) -> None:
        """Apply the relaxations of the plain iterations since the counts were last read.
        n of them at once are RELAX^n: relaxing moves an estimate below the prior towards
        it, never past it, so the positions relaxed stay the same throughout."""
        n, self._relaxing = self._relaxing, 0
        if n:
            self._decay(below_prior=True, times=n)

    def shrinkage(self) -> float:
        """Pseudo-drafts by which an octave's estimates are shrunk towards the pooled ones:
        the beta prior around the pooled rate of a first draft whose variance is the
        octaves' between-octave variance (method of moments, counts as sample sizes)."""
        w_max = OCTAVE_WEIGHT
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
        return max(MIN_OCTAVE_WEIGHT, noise / between - 1)

    def alphas(self, octave: int | None = None) -> list[float]:
        """Estimates at `octave`: its own counts shrunk towards the pooled estimate (None:
        the pooled estimate, every octave's counts shrunk towards the prior)."""
        w = PRIOR_WEIGHT
        reached, accepted = self.totals()
        pooled = [
            (a + w * p) / (r + w) for a, r, p in zip(accepted, reached, self._prior, strict=True)
        ]
        own = self._counts.get(octave) if octave is not None else None
        if own is None:
            return pooled
        w = self.shrinkage()
        return [(a + w * p) / (r + w) for r, a, p in zip(*own, pooled, strict=True)]

    def taus(self, octave: int | None = None) -> list[float]:
        """[k_max + 1] tau(k): tokens one row emits per iteration drafting k, at `octave`
        (None: pooled), less the tokens cut after a predicted stop."""
        taus, run = [1.0], 1.0
        lost = self._lost(octave)
        for a in self.alphas(octave):
            run = a if self.tree else run * a
            taus.append(taus[-1] + run)
        return [taus[0], *(max(t - lost, 1.0) for t in taus[1:])]

    def _lost(self, octave: int | None) -> float:
        """Tokens per row a drafting iteration verifies and then discards: drafts and
        the bonus token past a stop token (a drafter that predicts how answers end — the
        history — has its stop token accepted, and what follows it is cut). Decayed per
        drafting iteration like the counts; with `PRIOR_WEIGHT` pseudo-rows of none."""
        w = self._waste.get(octave) if octave is not None else None
        if w is None:
            w = [sum(x[0] for x in self._waste.values()), sum(x[1] for x in self._waste.values())]
        return w[0] / (w[1] + PRIOR_WEIGHT)

    def _decay(self, below_prior: bool, times: int = 1) -> None:
        """Decay the counts of positions whose pooled estimate is below (`below_prior`, by
        RELAX: a plain iteration) or not below the prior (by DECAY: a drafting one),
        `times` times."""
        factor = (RELAX if below_prior else DECAY) ** times
        if factor == 1.0:
            return
        # a tree's node i relaxes i + 1 times slower (as its prior weighs): the budget
        # that re-measures it costs ~(i + 1)x more, and a relaxed deep node would bring
        # back the prior's optimism for a big tree (32 nodes: 2 tokens), which a row
        # drafting alone pays ~2.6 plain iterations to measure again
        slow = self.tree and below_prior
        # on the pooled estimate: every octave's counts of a position decay alike, so
        # their sum decays as one pooled count would
        for j, a in enumerate(self.alphas()):
            if (a < self._prior[j]) == below_prior:
                f = factor ** (1 / (j + 1)) if slow else factor
                for reached, accepted in (self._pool, *self._counts.values()):
                    reached[j] *= f
                    accepted[j] *= f

    def observe_counts(self, rows: int, accepted: list[int], tokens: int | None = None) -> None:
        """Rows verified (the batch size, whose octave the counts go to), and per position
        j the rows whose drafts 0..j were all accepted (and drafted); trees: per node j,
        the rows whose accepted path went through it. `tokens`: what the rows recorded
        (None: every accepted draft and bonus token)."""
        k = min(len(accepted), self.k_max)
        if k == 0:
            return
        acc = accepted[:k]
        self._decay(below_prior=False)  # the others relax when read (`_settle`)
        b = octave(rows)
        waste = self._waste.setdefault(b, [0.0, 0.0])  # decayed (tokens lost, rows)
        waste[0] *= DECAY
        waste[1] = waste[1] * DECAY + rows
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
