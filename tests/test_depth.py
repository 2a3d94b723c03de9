"""Depth policies: the adaptive choice follows cost and acceptance; outputs never change."""

from __future__ import annotations

import math

import pytest
import torch

from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine import acceptance as A
from specroll.engine import depth as D
from specroll.engine.acceptance import OCTAVE_WEIGHT, PRIOR, PRIOR_WEIGHT, RELAX
from specroll.engine.calibration import BORROW, CHECK_AFTER
from specroll.engine.costmodel import CostModel, fit_linear, fit_target
from specroll.engine.depth import MARGIN, QUIET, REFRESH, AdaptiveDepth, FixedDepth


def shrunk(accepted: float, reached: float) -> float:
    """An estimate from counts, with the prior's pseudo-drafts."""
    return (accepted + PRIOR_WEIGHT * PRIOR) / (reached + PRIOR_WEIGHT)


def test_expected_tokens_and_online_acceptance():
    d = AdaptiveDepth(CostModel(fixed=1.0), k_max=3)
    # 4 rows drafted 3 tokens: accepted prefixes of length 3, 1, 0, 2
    acc = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    d.observe(torch.tensor([3, 3, 3, 3]), acc)
    a = [shrunk(3, 4), shrunk(2, 3), shrunk(1, 2)]
    assert d.alphas().tolist() == pytest.approx(a)
    assert d.expected_tokens(3) == pytest.approx(1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2])
    assert d.expected_tokens(0) == 1.0


def test_adaptive_picks_deep_when_verification_is_free_and_zero_when_it_is_not():
    cheap = CostModel(fixed=0.01, per_token=1e-6, knee=64, draft_step=1e-4)
    hi = AdaptiveDepth(cheap, k_max=5)
    assert hi.best(1) == 5
    costly = CostModel(fixed=0.0, per_token=0.01, knee=1, draft_step=1e-3)  # linear in tokens
    assert AdaptiveDepth(costly, k_max=5).best(8) == 0
    # a draft that is never accepted switches speculation off (a draft costs 20%)
    d = AdaptiveDepth(CostModel(fixed=0.01, draft_step=2e-3), k_max=5)
    assert d.best(1) >= 1  # before any evidence: the prior says drafting pays
    for _ in range(50):
        d.observe(torch.full((4,), 5), torch.zeros(4, 5, dtype=torch.bool))
    assert d.best(1) == 0


@pytest.mark.filterwarnings("ignore:the hardware profile disagrees")
def test_adaptive_depth_never_changes_the_samples(tiny_model):
    from specroll.drafters.ngram import NgramDrafter

    cm = CostModel(fixed=0.01, per_token=1e-5, knee=8, draft_step=1e-4)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 97, (6,), generator=g).tolist()
    reqs = [Request(base * 3, SamplingParams(0.0, max_new_tokens=40)) for _ in range(6)]
    plain = Engine(tiny_model, EngineConfig(max_batch=3)).generate(reqs)
    eng = Engine(tiny_model, EngineConfig(max_batch=3), NgramDrafter(), AdaptiveDepth(cm, 4))
    spec = eng.generate(reqs)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert eng.stats.drafts > 0
    assert FixedDepth(3, max_batch=2).choose(3) == 0


def test_cost_model_fit_recovers_known_coefficients(tmp_path):
    true = CostModel(fixed=2e-3, per_token=5e-4, knee=8, kv=1e-8, attn=3e-9)
    pts = [
        {"B": B, "q": q, "ctx": c, "seconds": true.target(B, q, c)}
        for B in (1, 2, 4, 8, 16)
        for q in (1, 2, 4)
        for c in (64, 512)
    ]
    coef, err = fit_target(pts)
    assert err["mape"] < 1e-6
    assert coef["knee"] == 8 and coef["per_token"] == pytest.approx(5e-4, rel=1e-6)
    a, b, mape = fit_linear([1, 2, 4], [1.5, 2.0, 3.0])
    assert (a, b) == pytest.approx((1.0, 0.5)) and mape < 1e-9
    true.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json") == true
    with pytest.raises(ValueError, match="does not exist"):
        CostModel.load(tmp_path / "missing.json")


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """`specroll.engine.profile` with profiling replaced by a counter (profile n has
    fixed = n ms, per_token 0.1 ms) and its cache under tmp_path; yields (module, calls)."""
    from specroll.engine import profile as P

    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))
    calls = []

    def fake(model, drafter, prompts, **kw):
        calls.append(1)
        return CostModel(fixed=len(calls) * 1e-3, per_token=1e-4, meta={"format": P.FORMAT})

    monkeypatch.setattr(P, "profile", fake)
    return P, calls


def test_cached_profile_is_measured_once_and_remeasured_when_stale(tiny_model, tmp_path, measured):
    from specroll.drafters.ngram import NgramDrafter

    P, calls = measured
    d = NgramDrafter()
    first = P.cached_profile(tiny_model, d, [[1, 2, 3]], P.MEASURE, log=lambda m: None)
    again = P.cached_profile(tiny_model, d, [[1, 2, 3]], P.MEASURE, log=lambda m: None)
    assert len(calls) == 1 and again == first
    (path,) = (tmp_path / "profiles").iterdir()
    stale = CostModel.load(path)
    stale.meta = {"format": P.FORMAT - 1}
    stale.save(path)
    P.cached_profile(tiny_model, d, [[1, 2, 3]], P.MEASURE, log=lambda m: None)
    assert len(calls) == 2
    given = P.cached_profile(tiny_model, d, [], path=str(path), log=lambda m: None)
    assert given.fixed == 2e-3


def test_without_a_cached_profile_a_quick_one_is_measured_and_nothing_cached(
    tiny_model, tmp_path, measured
):
    """A run starts at once: no cached profile means the coarse grid (seconds), kept in
    memory only — the next run does the same rather than trust a coarse file."""
    from specroll.drafters.ngram import NgramDrafter

    P, calls = measured
    seen = []
    counted = P.profile

    def spy(model, drafter, prompts, **kw):
        seen.append({k: v for k, v in kw.items() if k != "log"})
        return counted(model, drafter, prompts, **kw)

    P.profile = spy
    try:
        cm = P.cached_profile(tiny_model, NgramDrafter(), [[1]], log=lambda m: None)
    finally:
        P.profile = counted
    assert cm.meta["quick"] and seen == [P.QUICK]
    assert not (tmp_path / "profiles").exists()


def step(d: AdaptiveDepth, B: int, ctx: float = 0.0) -> int:
    """One engine iteration on a machine the profile describes exactly."""
    k = d.choose(B, ctx)
    d.observe_time(B, k, ctx, d.cost.iteration(B, k, ctx))
    return k


def test_adaptive_probes_again_after_an_unlucky_start():
    """A few early rejections push the estimate below break-even; without evidence the
    counts relax to the prior, so drafting is tried again (and then kept, if it pays)."""
    cm = CostModel(fixed=0.01, per_token=1e-3, knee=1, draft_step=1e-3)  # k=1 pays if a > 0.2
    d = AdaptiveDepth(cm, k_max=1)
    assert [step(d, 1), step(d, 1)] == [0, 1]  # plain measured first; the prior says draft
    for _ in range(20):  # unlucky: a run of rejected drafts
        d.observe(torch.ones(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.bool))
    assert step(d, 1) == 0
    half = math.log(2) / -math.log(RELAX)  # plain iterations that relax an estimate halfway
    waited = next(i for i in range(int(4 * half)) if step(d, 1) == 1)
    assert 0 < waited < 2 * half
    costly = CostModel(fixed=0.0, per_token=0.01, knee=1, draft_step=1e-3)
    e = AdaptiveDepth(costly, k_max=3)
    picks = [step(e, 32) for _ in range(300)]  # no probing where it cannot pay ...
    assert sorted(set(picks)) == [0, 1]  # ... but one probe, one step deeper than measured
    assert picks.count(1) == 1  # (depth 1), once: it is never predicted close enough again


def test_tokens_cut_after_a_predicted_stop_are_not_counted_as_gained():
    """A drafter that predicts how answers end has its stop token accepted, and what
    follows it (the bonus token) is cut: measured, those tokens come off tau(k)."""
    d = AdaptiveDepth(CostModel(fixed=1.0), k_max=1, tree=True)
    for _ in range(50):  # 8 rows; every draft accepted, but 4 rows end on it
        d.observe_counts(8, [8], tokens=12)  # 8 drafts + 4 bonus tokens kept, 4 cut
    assert d.alphas(8)[0] > 0.95
    assert d.expected_tokens(1, 8) == pytest.approx(1.5, abs=0.05)
    e = AdaptiveDepth(CostModel(fixed=1.0), k_max=1, tree=True)
    for _ in range(50):
        e.observe_counts(8, [8])  # the engine did not say: nothing is taken off
    assert e.expected_tokens(1, 8) > 1.95 and e.expected_tokens(0, 8) == 1.0


def test_a_gain_within_the_margin_is_not_taken():
    """Verification as cheap as plain decoding and 1 % of drafts kept: drafting would
    gain 1 %, inside the estimates' error (`MARGIN`), so plain decoding is kept; a gain
    just beyond it is taken."""
    picks = {}
    for kept in (1, 3):  # per 100 drafts
        d = AdaptiveDepth(CostModel(fixed=1.0), k_max=1)
        for _ in range(300):
            d.observe_counts(100, [kept])
        assert d.expected_tokens(1, 100) == pytest.approx(1 + kept / 100, abs=0.001)
        picks[kept] = d.best(100)
    assert 0.01 < MARGIN < 0.03 and picks == {1: 0, 3: 1}


class Counted(CostModel):
    """A cost model that counts the predictions asked of it while `counting`."""

    counting = False
    asked = 0

    def iteration(self, *a, **kw) -> float:
        self.asked += self.counting
        return super().iteration(*a, **kw)


def test_a_batch_far_from_paying_stays_plain_without_deciding_again(monkeypatch):
    """Where every depth is predicted far below plain decoding (a rollout's large-batch
    head), the policy re-decides only every `QUIET` iterations: the same choices as a
    policy that decides every iteration, a fraction of the predictions (and Python)."""
    picks, decided = {}, {}
    for quiet in (0, QUIET):
        monkeypatch.setattr(D, "QUIET", quiet)
        costly = Counted(fixed=0.0, per_token=0.01, knee=1, draft_step=1e-3)
        d = AdaptiveDepth(costly, k_max=3)
        picks[quiet], decisions = [], 0
        for _ in range(300):
            costly.counting, before = True, costly.asked
            k = d.choose(32)
            costly.counting = False
            decisions += costly.asked > before
            d.observe_time(32, k, 0.0, costly.iteration(32, k, 0.0))
            picks[quiet].append(k)
        decided[quiet] = decisions
    assert picks[QUIET] == picks[0] and set(picks[0]) == {0, 1}
    assert decided[0] == 300 and decided[QUIET] <= 300 // QUIET + 4


def test_a_tail_starts_from_what_the_last_tail_measured(monkeypatch):
    """A drafter accepting 10 % (below the prior of 50 %) is measured in one rollout's
    tail; the next rollout's large-batch head (300 plain iterations) must not hand its
    tail back the prior's optimism, or it would draft at a loss until it measured again."""
    cm = CostModel(fixed=0.01, per_token=1e-3, knee=1, draft_step=1e-3)  # B=2: pays if a > 0.25
    for relax, drafts_again in ((0.98, True), (RELAX, False)):
        monkeypatch.setattr(A, "RELAX", relax)  # relaxing as fast as the counts decay: not
        d = AdaptiveDepth(cm, k_max=1)
        for i in range(60):  # the tail: 2 rows, one accepted draft in ten
            d.observe_counts(2, [int(i % 5 == 0)])
        assert d.alphas(2)[0] < 0.15 and d.best(2) == 0
        for _ in range(300):  # the next head: plain decoding at batch 32
            d.choose(32)
            d.observe_time(32, 0, 0.0, cm.iteration(32, 0, 0.0))
        assert (d.best(2) == 1) is drafts_again
    assert d.alphas(2)[0] < 0.2


def test_acceptance_is_estimated_per_batch_octave():
    """Where acceptance differs with the batch size (a tail's long answers), each octave
    is judged on its own evidence once it has enough, and on the pooled one before."""
    d = AdaptiveDepth(CostModel(fixed=1.0), k_max=2)
    for _ in range(100):
        d.observe_counts(1, [1, 1])  # batch 1: every draft accepted (100 rows)
        d.observe_counts(8, [0, 0])  # batch 8: none (800 rows)
    pooled = d.alphas()
    assert pooled[0] == pytest.approx(shrunk(100, 900), rel=1e-3)  # below the prior: kept
    assert d.alphas(1)[0] > 0.85 and d.alphas(8)[0] < 0.01
    assert d.alphas(32).tolist() == pooled.tolist()  # no evidence there: the pooled one
    assert d.expected_tokens(2, 1) > 2.6 and d.expected_tokens(2, 8) < 1.02
    assert d.best(1) == 2  # free verification: drafting pays wherever a draft is kept
    d.observe_counts(16, [1, 0])  # one iteration at a new octave moves it a little only
    assert abs(d.alphas(16)[0] - pooled[0]) < 0.05


def test_octaves_that_disagree_are_pooled_less(monkeypatch):
    """How far an octave is shrunk towards the pooled estimate is measured: where the
    octaves' rates agree within noise, by `octave_weight`; where a tail's rows accept
    clearly less than the head's probes (a third against a tenth), a few dozen tail
    drafts outweigh the head, so the tail stops drafting at a loss."""

    def measured(tail_accepts: int) -> AdaptiveDepth:
        d = AdaptiveDepth(CostModel(fixed=1.0), k_max=1)
        for _ in range(25):  # the head's probes: 400 rows at batch 16, 5 in 16 accepted
            d.observe_counts(16, [5])
        for i in range(20):  # the tail: 40 rows at batch 2
            d.observe_counts(2, [int(i < tail_accepts)])
        return d

    monkeypatch.setattr(A, "DECAY", 1.0)  # every draft counted alike: the rates as stated
    agree = measured(tail_accepts=12)  # 30 % at both
    assert agree.shrinkage() == OCTAVE_WEIGHT
    tail = measured(tail_accepts=4)  # 10 % at batch 2
    assert tail.shrinkage() < 16 and tail.alphas(2)[0] < 0.15
    monkeypatch.setattr(A, "MIN_OCTAVE_WEIGHT", OCTAVE_WEIGHT)  # pooled as if they agreed:
    assert tail.alphas(2)[0] > 0.2  # the head's optimism


# ---------------------------------------------------------------- online calibration
#
# A rollout simulated in pure Python: a synthetic "true" machine (a CostModel used as the
# ground truth, with multiplicative noise), a drafter accepting each position with
# probability `alpha`, requests of varied lengths on `max_batch` slots (finished rows are
# replaced from the queue, then the batch drains: the long tail). The policy under test
# is given a deliberately wrong profile and sees only what the engine would show it.

# a 2-core-CPU-like machine: flat below 16 tokens (memory bound), linear above
TRUE = CostModel(
    fixed=5e-3,
    per_token=6e-4,
    knee=16,
    kv=2e-8,
    draft_fixed=5e-4,
    draft_step=1.5e-3,
    draft_step_per_row=5e-5,
    overhead_fixed=3e-4,
    overhead_per_token=1e-5,
)


def wrong(cm: CostModel, **scale: float) -> CostModel:
    """`cm` with some coefficients multiplied (a deliberately wrong profile)."""
    return CostModel(
        **{
            f: getattr(cm, f) * scale.get(f, 1.0)
            for f in (
                "fixed",
                "per_token",
                "kv",
                "attn",
                "draft_fixed",
                "draft_per_row",
                "draft_step",
                "draft_step_per_row",
                "overhead_fixed",
                "overhead_per_token",
            )
        },
        knee=cm.knee,
    )


class Oracle:
    """Best k per iteration from the true cost and the true acceptance (plain decoding's
    rate raised by `MARGIN`, as the policy's `best`)."""

    def __init__(self, true: CostModel, alpha: float, k_max: int = 7) -> None:
        self.true, self.alpha, self.k_max = true, alpha, k_max

    def choose(self, B, ctx=0.0):
        def rate(k: int) -> float:
            tau = sum(self.alpha**i for i in range(k + 1))
            return B * tau / self.true.iteration(B, k, ctx) * (1 + MARGIN if k == 0 else 1)

        return max(range(self.k_max + 1), key=rate)

    def observe(self, *a):
        pass

    def observe_time(self, *a):
        pass


def rollout(policy, true, alpha, steps=3, n=64, max_batch=32, new=128, noise=0.05, seed=0):
    """[steps] (tokens, seconds) of simulated rollouts sharing one policy (as RL steps do)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        # response lengths (the same for every policy): a third hit the budget
        gl = torch.Generator().manual_seed(seed * 1000 + step)
        gn = torch.Generator().manual_seed(seed * 1000 + step + 500)  # timing noise
        lengths = torch.where(
            torch.rand(n, generator=gl) < 0.33, new, torch.randint(16, new, (n,), generator=gl)
        ).tolist()
        queue, rows, tokens, seconds = list(lengths), [], 0, 0.0
        while queue or rows:
            while queue and len(rows) < max_batch:
                rows.append([queue.pop(), 40])  # [tokens left, context]
            B = len(rows)
            ctx = sum(r[1] for r in rows) / B
            k = policy.choose(B, ctx)
            t = true.iteration(B, k, ctx) * math.exp(noise * float(torch.randn(1, generator=gn)))
            acc = torch.zeros(B, k, dtype=torch.bool)
            if k:
                acc = torch.cumprod((torch.rand(B, k, generator=g) < alpha).long(), 1).bool()
                policy.observe(torch.full((B,), k), acc)
            policy.observe_time(B, k, ctx, t)
            seconds += t
            for r, a in zip(rows, acc.sum(1).tolist(), strict=True):
                e = min(1 + a, r[0])
                r[0] -= e
                r[1] += e
                tokens += e
            rows = [r for r in rows if r[0] > 0]
        out.append((tokens, seconds))
    return out


def speed(runs, skip=0):
    """Tokens per second over the runs (after `skip` warm-up runs)."""
    return sum(t for t, _ in runs[skip:]) / sum(s for _, s in runs[skip:])


PLAIN = FixedDepth(0)


@pytest.mark.filterwarnings("ignore:the hardware profile disagrees")
@pytest.mark.parametrize(
    "profile",
    [
        dict(draft_fixed=0.1, draft_step=0.1, draft_step_per_row=0.1, per_token=0.2),
        dict(fixed=10.0),  # plain decoding looks 10x dearer: verification looks free
        dict(per_token=0.1, kv=0.1),  # "measured at batch 1 only"
    ],
    ids=["draft-and-tokens-cheap", "fixed-10x", "flat"],
)
def test_wrong_profile_never_loses_when_drafting_does_not_pay(profile):
    """A weak drafter (alpha 0.08): plain decoding is best at every batch size. A profile
    that says drafting pays must not make adaptive depth slower than plain decoding."""
    alpha = 0.08
    assert all(Oracle(TRUE, alpha).choose(B, 100.0) == 0 for B in (1, 2, 4, 8, 16, 32))
    naive = AdaptiveDepth(wrong(TRUE, **profile), k_max=7)
    assert max(naive.best(B, 100.0) for B in (1, 4, 32)) > 0  # the profile is misleading
    plain = rollout(PLAIN, TRUE, alpha)
    runs = rollout(AdaptiveDepth(wrong(TRUE, **profile), k_max=7), TRUE, alpha)
    assert speed(runs[:1]) >= 0.98 * speed(plain[:1])  # the first rollout: exploration
    assert speed(runs, skip=1) >= 0.99 * speed(plain, skip=1)


@pytest.mark.filterwarnings("ignore:the hardware profile disagrees")
@pytest.mark.parametrize(
    "profile",
    [
        dict(draft_fixed=0.1, draft_step=0.1, draft_step_per_row=0.1, per_token=0.2),
        dict(fixed=10.0),
        dict(draft_fixed=10.0, draft_step=10.0, draft_step_per_row=10.0),  # drafting "dear"
        dict(fixed=0.3, per_token=3.0),  # everything measured on a busier machine, skewed
    ],
    ids=["draft-and-tokens-cheap", "fixed-10x", "draft-10x-dear", "skewed"],
)
def test_wrong_profile_converges_to_the_best_depths(profile):
    """A good drafter (alpha 0.7): speculation pays in small batches, loses in large
    ones. Whatever the profile, the policy ends up choosing (nearly) the true best k and
    keeps most of the oracle's gain."""
    alpha = 0.7
    oracle = Oracle(TRUE, alpha)
    assert oracle.choose(1, 100.0) >= 3 and oracle.choose(32, 100.0) == 0
    plain, best = rollout(PLAIN, TRUE, alpha), rollout(oracle, TRUE, alpha)
    d = AdaptiveDepth(wrong(TRUE, **profile), k_max=7)
    runs = rollout(d, TRUE, alpha)
    assert speed(runs[:1]) >= speed(plain[:1])
    gain, most = speed(runs, skip=1) / speed(plain, skip=1), speed(best, skip=1) / speed(plain, 1)
    assert most > 1.04 and gain - 1 >= 0.8 * (most - 1)
    # the learnt times pick what the truth picks at the ends of the batch range
    d.choose(32, 100.0)  # (the next choice at 32 may be a scheduled probe)
    assert d.rates(32, 100.0)[0] == max(d.rates(32, 100.0))
    r1 = d.rates(1, 100.0)
    k1 = max(range(8), key=r1.__getitem__)
    assert k1 > 0 and r1[k1] >= 1.3 * r1[0]


def test_time_calibration_is_measured_per_batch_octave():
    cm = CostModel(fixed=1e-2, per_token=1e-3, knee=4, draft_step=1e-3)
    d = AdaptiveDepth(cm, k_max=4)
    assert [AdaptiveDepth.octave(B) for B in (1, 2, 3, 4, 7, 8, 32)] == [0, 1, 1, 2, 2, 3, 5]
    assert d.corrections(8) == [0.0] * 5  # nothing measured: the profile as it is
    for _ in range(5):
        d.observe_time(8, 0, 0.0, 2 * cm.iteration(8, 0, 0.0))  # twice the profile
        d.observe_time(9, 2, 0.0, 4 * cm.iteration(9, 2, 0.0))  # four times at k = 2
    c = d.corrections(12)
    assert c[0] == pytest.approx(math.log(2)) and c[2] == pytest.approx(math.log(4))
    assert c[1] == pytest.approx(math.log(2) + math.log(2) / 2)  # interpolated in k
    assert c[4] == pytest.approx(math.log(4))  # deeper: like the deepest measured ...
    t = d.times(12)  # ... or the measured times' slope, whichever is lower
    pred = [cm.iteration(12, k, 0.0) for k in range(5)]
    slope = (4 * pred[2] - 2 * pred[0]) / 2
    assert t[3] == pytest.approx(min(4 * pred[3], 4 * pred[2] + slope))
    # another octave: its own plain time, the relative cost of drafting borrowed, shrunk
    d.observe_time(2, 0, 0.0, cm.iteration(2, 0, 0.0))
    c2 = d.corrections(2)
    assert c2[0] == pytest.approx(0.0)
    assert c2[2] == pytest.approx(math.log(2) * BORROW**2)
    # outliers: the median of the window
    d.observe_time(8, 0, 0.0, 50 * cm.iteration(8, 0, 0.0))
    assert d.corrections(8)[0] == pytest.approx(math.log(2))
    assert set(d.calibration()) == {"B8-15", "B2-3"}


def test_exploration_is_deterministic_and_cheap():
    """Plain decoding runs once per octave before speculating there (and every `REFRESH`
    iterations), depths are tried one step deeper at a time, and two policies fed the
    same observations choose alike (no RNG)."""
    cheap = CostModel(fixed=1e-2, per_token=1e-5, knee=64, draft_step=1e-4)
    assert AdaptiveDepth(cheap, k_max=3).best(1) == 3
    d = AdaptiveDepth(cheap, k_max=3)
    n = 4 * REFRESH
    picks = [step(d, 1) for _ in range(n)]
    assert picks[:4] == [0, 1, 2, 3]
    plain = [i for i, k in enumerate(picks) if k == 0]  # first, then every ~REFRESH
    gaps = [b - a for a, b in zip(plain, plain[1:], strict=False)]
    assert plain[0] == 0 and len(gaps) >= 3 and all(REFRESH < g <= REFRESH + 3 for g in gaps)
    assert picks.count(3) > 0.9 * n
    e = AdaptiveDepth(cheap, k_max=3)
    assert [step(e, 1) for _ in range(n)] == picks


def test_undrafted_positions_count_as_rejected():
    """An n-gram drafter that finds no match drafts nothing, yet the target verifies k+1
    columns: tau(k) must include those rows as rejections."""
    d = AdaptiveDepth(CostModel(fixed=1.0), k_max=2)
    acc = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    d.observe(torch.tensor([2, 0]), acc)  # row 1 drafted nothing
    assert d.alphas().tolist() == pytest.approx([shrunk(1, 2), shrunk(1, 1)])


def test_profile_that_disagrees_with_measured_times_is_marked_stale(tiny_model, tmp_path, measured):
    from specroll.drafters.ngram import NgramDrafter

    P, calls = measured
    cm = P.cached_profile(tiny_model, NgramDrafter(), [[1]], P.MEASURE, log=lambda m: None)
    d = AdaptiveDepth(cm, k_max=3)
    for i in range(CHECK_AFTER - 1):  # within the band: nothing happens
        d.observe_time(4, i % 2, 50.0, 1.2 * cm.iteration(4, i % 2, 50.0))
    d.observe_time(4, 0, 50.0, 1.2 * cm.iteration(4, 0, 50.0))
    assert d.disagreement is None
    assert len(calls) == 1 and P.cached_profile(tiny_model, NgramDrafter(), [[1]]) == cm

    cm = P.cached_profile(tiny_model, NgramDrafter(), [[1]], P.MEASURE, log=lambda m: None)
    d = AdaptiveDepth(cm, k_max=3)
    with pytest.warns(RuntimeWarning, match="disagrees"):
        for _ in range(CHECK_AFTER):  # plain decoding 3x slower than the profile says
            d.observe_time(4, 0, 50.0, 3 * cm.iteration(4, 0, 50.0))
    assert d.disagreement["all"] == pytest.approx(3.0)
    logs = []
    P.cached_profile(tiny_model, NgramDrafter(), [[1]], P.MEASURE, log=logs.append)
    assert len(calls) == 2 and any("disagreed" in m for m in logs)
    # a profile the user gave is never rewritten
    (path,) = (tmp_path / "profiles").iterdir()
    given = P.cached_profile(tiny_model, NgramDrafter(), [], path=str(path))
    assert not given.mark_stale("x") and "stale" not in CostModel.load(path).meta
