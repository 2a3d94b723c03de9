"""Speculative decoding through the real engine is exactly plain decoding.

Sampled chains (q-ratio acceptance) draw differently from plain decoding, so their law is
tested: the verifier's exactly (tests/test_verify.py, an exact enumeration of what it
emits), and here what exactness asks of the drafters and of the engine's wiring:

* every sampling drafter's drafts are the inverse CDF of the very q it hands the
  verifier, at its own DRAFT-stream uniform (deterministic, every setting);
* end to end, one chi-square per drafter family: the joint distribution of the first
  three generated tokens, sampled through the engine with a draft network (EAGLE-3) and
  with n-grams, against plain decoding's exact joint (enumerated on a 16-token
  vocabulary), rows of k = 0..3 side by side; the same test fails against a broken
  verifier, so a pass means something (trees: tests/test_tree.py). The other drafters
  and settings, and bf16, run under -m slow;
* greedy: 100% token-identical to plain greedy decoding over 128 tokens.

The chi-square tests run in fp32 and (slow) in bf16 with the same thresholds:
speculation is exact with respect to the engine's own distribution, so in bf16 the
reference is the bf16 model's (fp32-upcast) logits, and every draft network runs in bf16
too.
"""

from __future__ import annotations

import math
from statistics import median
from types import SimpleNamespace

import pytest
import torch

import specroll.spec.verify as V
from specroll.drafters.base import Proposal
from specroll.drafters.draft_model import DraftModelDrafter
from specroll.drafters.ngram import NgramDrafter
from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine.depth import FixedDepth
from specroll.model import Transformer
from specroll.model.weights import for_inference
from specroll.spec import rng
from specroll.spec.sampling import sample_from_probs
from tests.conftest import (
    JOINT_SAMPLES,
    PROMPT,
    VOCAB,
    chi2_pvalue,
    exact_joint,
    related_draft,
    sample_joint,
    spec_drafters,
    spec_model,
    tv_shifted,
)

SETTINGS = [  # temperature, top_k, top_p
    (0.7, 0, 1.0),
    (1.0, 0, 1.0),
    (1.5, 0, 1.0),
    (1.0, 6, 1.0),
    (1.0, 0, 0.85),
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
N = JOINT_SAMPLES


@pytest.fixture(scope="module")
def target():
    return spec_model(0)


@pytest.fixture(scope="module")
def targets(target) -> dict[str, Transformer]:
    """The test target in each engine dtype (bf16: a cast copy, RoPE tables kept fp32)."""
    return {"fp32": target, "bf16": for_inference(spec_model(0), "cpu", torch.bfloat16)}


# One chi-square per drafter family in the default suite: a draft network (EAGLE-3: a
# restricted draft vocabulary, q sampled under top-k) and n-grams (one-hot drafts, top-p).
# What the rest proved is covered without sampling: the verifier's law for any q at every
# setting (tests/test_verify.py) and each sampling drafter's drafts drawn from exactly the
# q it hands over (below). The whole grid runs under -m slow.
FAST_CASES = {("eagle3", 1.0, 6, 1.0), ("ngram", 1.0, 0, 0.85)}
JOINT_CASES = [
    pytest.param(d, *s, marks=() if (d, *s) in FAST_CASES else pytest.mark.slow)
    for d in ("ngram", "draft_model", "eagle3", "mtp")
    for s in SETTINGS
]
DRAFT_STREAM = rng.DRAFT
"""The stream sampling drafters draw from (fixed here: a drafter on another fails)."""


@pytest.mark.parametrize("drafter", ["draft_model", "eagle3", "mtp"])
def test_drafts_are_drawn_from_exactly_the_q_they_hand_the_verifier(target, drafter):
    """All a sampling drafter must do for the output to be exact (the verifier is exact
    for any q): every drafted token, at every setting, depth and row (k = 0..3 side by
    side), is the inverse CDF of its own q at the row's DRAFT-stream uniform for that
    output index: a fresh draw from q that shares no randomness with acceptance.
    Argmax drafts, another stream or another counter fail it."""
    for t, k, p in SETTINGS:
        d = spec_drafters(target)[drafter]()
        seen = []
        propose = d.propose

        def spy(batch, propose=propose, seen=seen):
            prop = propose(batch)
            seen.append((batch.seed.clone(), batch.n_gen.clone(), batch.num_draft.clone(), prop))
            return prop

        d.propose = spy
        reqs = [
            Request(
                PROMPT[: 3 + i % 5],
                SamplingParams(
                    t,
                    top_k=k,
                    top_p=p,
                    max_new_tokens=12,
                    stop_token_ids=(),
                    seed=i,
                    max_draft=i % 4,
                ),
            )  # fmt: skip
            for i in range(48)
        ]
        Engine(target, EngineConfig(max_batch=48), d, FixedDepth(3)).generate(reqs)
        drafted = 0
        for seed, n_gen, num_draft, prop in seen:
            for i in range(prop.tokens.shape[1]):
                live = num_draft > i
                u = rng.uniforms(seed, n_gen + i, DRAFT_STREAM)
                want = sample_from_probs(prop.probs[:, i].float(), u)
                assert torch.equal(prop.tokens[live, i], want[live]), (t, k, p, i)
                drafted += int(live.sum())
        assert drafted > 300


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("drafter,t,k,p", JOINT_CASES)
def test_joint_distribution_of_three_tokens_matches_plain_decoding(
    targets, drafter, t, k, p, dtype
):
    target = targets[dtype]
    make = spec_drafters(target)[drafter]
    engine = Engine(target, EngineConfig(max_batch=512), drafter=make(), depth=FixedDepth(3))
    counts = sample_joint(engine, N, t, k, p, mixed=True)
    s = engine.stats
    assert s.draft_tokens > N // 2  # speculation really happened, with both outcomes
    assert s.acceptance_rate < 0.95  # rejections (residual draws) are exercised
    if drafter == "draft_model":
        assert s.acceptance_rate > 0.05  # and so are acceptances
    exact = exact_joint(target, t, k, p)
    assert chi2_pvalue(counts, exact) > 1e-4
    # power: these counts reject a distribution 2% TV away (mass moved between the two
    # likeliest sequences), so a verifier bug of that size would fail this test
    assert chi2_pvalue(counts, tv_shifted(exact, 0.02)) < 1e-4


@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
@pytest.mark.parametrize("drafter", [pytest.param("ngram", marks=pytest.mark.slow), "draft_model"])
def test_the_same_test_fails_for_a_broken_verifier(targets, drafter, dtype, monkeypatch):
    """Recovered tokens drawn from p instead of the residual: a ~2-10% TV bias."""
    target = targets[dtype]
    monkeypatch.setattr(V, "residual_distribution", lambda p_, q_: p_)
    make = spec_drafters(target)[drafter]
    engine = Engine(target, EngineConfig(max_batch=512), drafter=make(), depth=FixedDepth(3))
    # a third of the samples: at 10k, p is 7e-25 (ngram, TV 0.06) and underflows to 0
    # (draft_model, TV 0.2) in fp32
    counts = sample_joint(engine, N // 3, 1.0, 0, 1.0, mixed=False)
    exact = exact_joint(target, 1.0, 0, 1.0)
    observed = counts.double() / counts.sum()
    assert chi2_pvalue(counts, exact) < 1e-6
    assert 0.5 * (observed - exact).abs().sum() > 0.02  # the bias is at least 2% TV


def test_oracle_draft_is_always_accepted(target):
    """The target as its own draft at the same temperature: acceptance 1, k+1 per forward."""
    for k in (1, 3, 5):
        engine = Engine(target, drafter=DraftModelDrafter(target), depth=FixedDepth(k))
        params = SamplingParams(1.0, max_new_tokens=1 + 8 * (k + 1), stop_token_ids=(), seed=1)
        engine.generate([Request(PROMPT, params)] * 4)
        s = engine.stats
        assert s.acceptance_rate > 0.999
        assert s.acceptance_length >= 0.98 * (k + 1)
        assert s.tokens_per_target_forward >= 0.98 * (k + 1)


class _Diluted(DraftModelDrafter):
    """The policy drafting for itself (q = p), except that each proposed token is, with
    probability `eps` (the drafter's own coin), a token z that the top-k-processed target
    gives probability 0; it hands over q' = (1 - eps) q + eps δ_z, the exact law of what
    it proposes. The verifier rejects z always (p(z)/q'(z) = 0) and accepts every other
    proposal (p(x)/q'(x) = 1/(1 - eps) > 1), so each position is accepted with
    probability a = 1 - eps, whatever the context and the other positions."""

    name = "diluted"
    in_step = False  # its `propose` is its own (no captured step proposes for it)

    def __init__(self, model: Transformer, eps: float, seed: int = 0) -> None:
        super().__init__(model)
        self.eps = eps
        self.coins = torch.Generator().manual_seed(seed)

    def propose(self, batch):
        prop = super().propose(batch)
        q = prop.probs  # [B, k, V]
        z = q.argmin(-1)  # outside the draft's top-k: the draft is the target, so p(z) = 0
        swap = (torch.rand(z.shape, generator=self.coins) < self.eps).to(z.device)
        mixed = (1 - self.eps) * q + self.eps * torch.nn.functional.one_hot(z, q.shape[-1])
        return Proposal(torch.where(swap, z, prop.tokens), mixed)


def _freedman(var: float, bound: float, n_max: int, delta: float = 1e-6) -> float:
    """t such that P(max over n <= n_max of |S_n| >= t) <= delta, for a martingale S_n
    whose increments are bounded by `bound` and have conditional variance `var`
    (Freedman's inequality: the probability is <= 2 exp(-t^2 / (2 (n_max var + bound t / 3))))."""
    L = math.log(2 / delta)
    return bound * L / 3 + math.sqrt((bound * L / 3) ** 2 + 2 * n_max * var * L)


def test_acceptance_length_of_a_drafter_with_known_acceptance(target):
    """With every position accepted with probability a (`_Diluted`), a draft of d tokens
    accepts A in {0..d}, P(A >= i) = a^i: E[A | d] = a + ... + a^d, and the per-position
    acceptance i is a^(i+1).

    Rows draft k = 3 tokens except near the end of their budget, where a row with r
    tokens to go drafts r - 1 (it could keep no more), so the expectation is taken over
    the drafts as counted: E[accepted] = sum_i a^(i+1) drafted_per_pos[i]. Noise bound:
    d_j is known before draft j is verified, so S_n = sum_{j<=n} (A_j - E[A | d_j]) is a
    martingale with increments bounded by k and conditional variance at most var_k =
    sum_{i,j<=k} a^max(i,j) - mu_k^2 (the largest over d <= k here), and the number of
    drafts N <= n_max = rows * (budget - 1) (an iteration emits at least one token).
    By Freedman's inequality |S_N| < t except with probability 1e-6, hence
    |AL - (1 + E[accepted] / N)| < t / N: about 0.16 here (n_max is ~2.2 N, so that is
    ~8 standard errors), against a shift of 1 for an acceptance count off by one per
    draft, or of ~0.8 for one that counts the first rejected token. Per position, the
    same with Bernoulli(a^(i+1)) increments (bound 1): about 0.06."""
    k, eps, rows, budget = 3, 0.4, 128, 64
    a = 1 - eps
    eng = Engine(target, EngineConfig(max_batch=rows), _Diluted(target, eps), FixedDepth(k))
    params = [
        SamplingParams(1.0, top_k=4, max_new_tokens=budget, stop_token_ids=(), seed=i)
        for i in range(rows)
    ]
    eng.generate([Request(PROMPT, p) for p in params])
    s = eng.stats
    N = s.drafts
    # counted: a row drafts k tokens until its budget leaves fewer to keep, then r - 1
    assert sum(s.depth_hist) == s.target_forwards and s.depth_hist[k] > 0.9 * s.target_forwards
    assert s.drafted_per_pos[0] == N and s.draft_tokens == sum(s.drafted_per_pos)
    assert s.drafted_per_pos == sorted(s.drafted_per_pos, reverse=True)
    assert N > 0.98 * s.row_forwards  # at most the last iteration of a row drafts nothing
    # every verified token is kept: an iteration emits its accepted drafts + 1, and no
    # row drafts past its budget
    assert s.emitted_tokens == rows * (budget - 1)  # + the prefill token per row
    assert s.emitted_tokens == s.accepted_tokens + s.row_forwards
    # statistical: the exact expectation within the bound
    reach = [a ** (i + 1) for i in range(k)]  # P(the first i+1 accepted)
    expected = 1 + sum(r * d for r, d in zip(reach, s.drafted_per_pos, strict=True)) / N
    mu = sum(reach)
    var = sum(a ** max(i, j) for i in range(1, k + 1) for j in range(1, k + 1)) - mu**2
    n_max = rows * (budget - 1)
    tol = _freedman(var, k, n_max) / N
    assert tol < 0.2  # tight enough to see a count off by one
    assert abs(expected - (1 + mu)) < 0.05  # few drafts are cut short by the budget
    assert abs(s.acceptance_length - expected) < tol, (s.acceptance_length, expected, tol)
    for got, want in zip(s.per_position, reach, strict=True):
        assert abs(got - want) < _freedman(want * (1 - want), 1, n_max) / N, (got, want)


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "oracle", "eagle3", "mtp"])
def test_greedy_is_token_identical_to_plain_decoding(drafter):
    """128 greedy tokens on several prompts, k = 1, 3, 5; log-probs equal the learner's."""
    target = spec_model(0, std=0.15)  # realistic activation scale for the log-prob check
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 14, 6)]
    params = SamplingParams(0.0, max_new_tokens=128, stop_token_ids=())
    plain = Engine(target).generate([Request(q, params) for q in prompts])
    for k in (1, 3, 5):
        eng = Engine(
            target, EngineConfig(max_batch=3), spec_drafters(target)[drafter](), FixedDepth(k)
        )
        spec = eng.generate([Request(q, params) for q in prompts])
        assert eng.stats.draft_tokens > 0
        for q, a, b in zip(prompts, plain, spec, strict=True):
            assert a.token_ids == b.token_ids
            with torch.enable_grad():  # the learner's path: full sequence, autograd on
                logits = target(torch.tensor([q + b.token_ids])).logits[0, len(q) - 1 : -1]
            ref = logits.detach().log_softmax(-1).gather(-1, torch.tensor(b.token_ids)[:, None])
            torch.testing.assert_close(torch.tensor(b.logprobs), ref[:, 0], atol=1e-5, rtol=0)


def test_seeded_determinism_and_batch_permutation_invariance(target):
    reqs = [
        Request(
            PROMPT[: 3 + i % 5], SamplingParams(1.0, max_new_tokens=20, seed=i, stop_token_ids=())
        )
        for i in range(12)
    ]

    def run(rs, max_batch):
        eng = Engine(
            target, EngineConfig(max_batch=max_batch), DraftModelDrafter(related_draft(target))
        )
        return [r.token_ids for r in eng.generate(rs)]

    first = run(reqs, 12)
    assert run(reqs, 12) == first
    assert run(reqs, 5) == first  # slot reuse and compaction
    assert run(list(reversed(reqs)), 7) == list(reversed(first))
    # with per-request seeds, speculation draws the same tokens as ... itself alone
    assert [run([r], 1)[0] for r in reqs[:3]] == first[:3]


def test_stop_token_and_budget_inside_an_accepted_run(target):
    params = SamplingParams(0.0, max_new_tokens=30, stop_token_ids=())
    plain = Engine(target).generate([Request(PROMPT, params)])[0].token_ids
    stop = plain[6]
    cut = plain.index(stop) + 1
    oracle = lambda: DraftModelDrafter(target)  # noqa: E731 - every draft is accepted
    eng = Engine(target, drafter=oracle(), depth=FixedDepth(5))
    r = eng.generate(
        [Request(PROMPT, SamplingParams(0.0, max_new_tokens=30, stop_token_ids=(stop,)))]
    )
    assert r[0].token_ids == plain[:cut] and r[0].finish_reason == "stop"
    for budget in (1, 2, 7, 11):
        eng = Engine(target, drafter=oracle(), depth=FixedDepth(5))
        p2 = SamplingParams(0.0, max_new_tokens=budget, stop_token_ids=())
        r = eng.generate([Request(PROMPT, p2)])[0]
        assert r.token_ids == plain[:budget] and r.finish_reason == "length"


def test_context_limit_reached_mid_draft(target):
    """A 252-token prompt in a 256-token window: 4 tokens, whatever k."""
    prompt = (PROMPT * 32)[:252]
    params = SamplingParams(0.0, max_new_tokens=20, stop_token_ids=())
    plain = Engine(target).generate([Request(prompt, params)])[0]
    assert plain.finish_reason == "context" and len(plain.token_ids) == 4
    for k in (1, 3, 5):
        eng = Engine(target, drafter=DraftModelDrafter(target), depth=FixedDepth(k))
        r = eng.generate([Request(prompt, params), Request(PROMPT, params)])
        assert r[0].token_ids == plain.token_ids and r[0].finish_reason == "context"


def test_no_row_drafts_more_than_its_budget_keeps(target):
    """k = 50 with 8 tokens to generate (the target drafting for itself, so every draft
    is accepted): rows draft at most what their budget keeps, and the acceptance length
    never exceeds the tokens an iteration emitted (it once read 51 for 8 tokens)."""
    eng = Engine(target, drafter=DraftModelDrafter(target), depth=FixedDepth(50))
    params = [SamplingParams(1.0, max_new_tokens=n, stop_token_ids=(), seed=n) for n in (8, 3)]
    res = eng.generate([Request(PROMPT, p) for p in params])
    s = eng.stats
    assert [len(r.token_ids) for r in res] == [8, 3]
    # the prefill token, then one iteration: 6 and 1 drafts, all accepted, + the bonus
    assert s.target_forwards == 1 and s.depth_hist[-1] == 1 and len(s.depth_hist) == 7
    assert s.drafted_per_pos == [2] + [1] * 5 and s.accepted_tokens == s.draft_tokens == 7
    assert s.emitted_tokens == 7 + 2  # every verified token kept
    assert [r.spec.acceptance_length for r in res] == [7, 2]  # = the tokens it emitted


def test_metrics_and_collapse_warning(target):
    eng = Engine(target, drafter=DraftModelDrafter(related_draft(target)), depth=FixedDepth(3))
    res = eng.generate([Request(PROMPT, SamplingParams(1.0, max_new_tokens=30, seed=0))])
    s = eng.stats
    r = res[0].spec
    assert (s.draft_tokens, s.accepted_tokens) == (r.draft_tokens, r.accepted_tokens)
    assert s.per_position == r.per_position and s.acceptance_length == r.acceptance_length
    assert s.emitted_tokens + 1 == len(res[0].token_ids)  # + the prefill token
    F = s.target_forwards  # one row: 3 drafts at every iteration, fewer near its budget
    assert sum(s.depth_hist) == F == s.row_forwards and s.depth_hist[3] >= F - 3
    # only an iteration with a single token to go decodes plainly
    assert s.depth_hist[0] <= 1 and s.drafts == F - s.depth_hist[0]
    assert (
        s.draft_tokens == sum(s.drafted_per_pos) == sum(i * n for i, n in enumerate(s.depth_hist))
    )
    assert s.drafted_per_pos[0] == s.drafts and sum(s.accepted_per_pos) == s.accepted_tokens
    # an iteration emits its accepted drafts + 1 (recovered or bonus), all kept unless a
    # stop token cuts the last one: no row drafts more than its budget can keep
    assert 0 <= s.accepted_tokens + F - s.emitted_tokens <= 3
    if res[0].finish_reason == "length":
        assert s.emitted_tokens == s.accepted_tokens + F
    assert s.acceptance_length == 1 + s.accepted_tokens / s.drafts
    assert s.per_position == sorted(s.per_position, reverse=True)  # cumulative

    # a drafter that always proposes a token greedy decoding (almost) never emits
    greedy = SamplingParams(0.0, max_new_tokens=60, stop_token_ids=())
    plain = Engine(target).generate([Request(PROMPT[:2], greedy)])[0].token_ids
    counts = torch.bincount(torch.tensor(plain), minlength=VOCAB)
    rare = int(counts.argmin())
    assert counts[rare] / len(plain) < 0.02

    class Stubborn(NgramDrafter):
        name = "stubborn"

        def propose(self, batch):
            return Proposal(torch.full((batch.last.shape[0], batch.k), rare), None)

    eng = Engine(target, drafter=Stubborn(), depth=FixedDepth(3))
    with pytest.warns(RuntimeWarning, match="stubborn.*version 0"):
        eng.generate([Request(PROMPT[:2], greedy)] * 8)


def test_compare_spec_scores_each_mode_by_its_own_tokens(target, monkeypatch):
    """`specroll draft eval` / `bench spec` rows: the policy drafting for itself is accepted
    every time (AL = k + 1, per-position 1.0), and with stop tokens on, where the modes
    emit different samples, each mode's tok/s counts its own tokens and the speed-up pairs
    the runs of a round. Timed by a scripted clock, so every figure is exact, not measured."""
    import specroll.engine.bench as bench

    # a clock that ticks only when read: runs of 1 s (plain), 2 s (spec), then 4 s and 1 s
    ticks = iter([0.0, 1.0, 10.0, 12.0, 20.0, 24.0, 30.0, 31.0])
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    # 25 tokens = the prefill's + 6 iterations of 3 drafts and a bonus: no row's budget
    # clamps its depth, so every iteration drafts k = 3
    reqs = [
        Request(PROMPT, SamplingParams(1.0, max_new_tokens=25, stop_token_ids=(5,), seed=s))
        for s in range(6)
    ]
    drafter = {"self": DraftModelDrafter(target)}
    (row,) = bench.compare_spec(target, reqs, drafter, 2, [3], 2, lambda _: 0)
    assert next(ticks, None) is None  # the clock was read at the start and end of each run
    assert row["acceptance_length"] == 4.0 and row["per_position"] == [1.0, 1.0, 1.0]
    # each round samples with fresh seeds (a drafter with history never meets the samples
    # it saw), the same for every mode within a round
    rounds = [[bench._reseeded(q, r * len(reqs)) for q in reqs] for r in range(2)]
    plain = Engine(target, EngineConfig(max_batch=2))
    spec = Engine(target, EngineConfig(max_batch=2), DraftModelDrafter(target), FixedDepth(3))
    n_plain, n_spec, tpf = [], [], []
    for batch in rounds:
        n_plain.append(sum(len(r.token_ids) for r in plain.generate(batch)))
        n_spec.append(sum(len(r.token_ids) for r in spec.generate(batch)))
        tpf.append(spec.stats.tokens_per_target_forward)
    assert n_plain[0] != n_spec[0]  # same distribution, other samples: lengths differ
    assert {q.params.seed for q in rounds[0]}.isdisjoint(q.params.seed for q in rounds[1])
    assert row["tokens_per_target_forward"] == round(median(tpf), 3)
    ar = [n_plain[0] / 1.0, n_plain[1] / 4.0]  # each run: its own tokens over its own time
    sp = [n_spec[0] / 2.0, n_spec[1] / 1.0]
    assert row["ar_tok_s"] == round(median(ar), 2) and row["spec_tok_s"] == round(median(sp), 2)
    # the median of per-round ratios, which neither the ratio of the medians nor ratios
    # across rounds would give
    assert row["speedup"] == round(median([s / a for s, a in zip(sp, ar, strict=True)]), 3)
    assert row["speedup"] not in (
        round(median(sp) / median(ar), 3),
        round(median([sp[0] / ar[1], sp[1] / ar[0]]), 3),
    )
