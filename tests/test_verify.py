"""The verifier is exact: analytically (TV < 1e-6) and by Monte-Carlo tests that can fail."""

from __future__ import annotations

import pytest
import torch

import specroll.spec.verify as V
from specroll.spec import rng
from specroll.spec.sampling import RowSampling, probs_from_logits, sample_from_probs
from tests.conftest import gof_pvalue

SETTINGS = [  # (temperature, top_k, top_p)
    (0.7, 0, 1.0),
    (1.0, 0, 1.0),
    (1.5, 0, 1.0),
    (1.0, 5, 1.0),
    (1.0, 0, 0.8),
    (0.7, 6, 0.9),
]


def _processed(logits, t, k, p):
    B = logits.shape[0]
    return probs_from_logits(logits, RowSampling.full(B, t, k, p))


@pytest.mark.parametrize("t,k,p", SETTINGS)
def test_output_distribution_is_exactly_the_target(t, k, p):
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        target = torch.randn(1, 16, generator=g) * 2
        draft = target + torch.randn(1, 16, generator=g)  # a related but different model
        pt, qd = _processed(target, t, k, p)[0], _processed(draft, t, k, p)[0]
        out = V.output_distribution(pt, qd)
        assert 0.5 * (out - pt.double()).abs().sum() < 1e-6
        # one-hot drafts: exact whatever token was proposed
        per_draft = V.output_distribution(pt, None)
        assert (0.5 * (per_draft - pt.double()).abs().sum(dim=1)).max() < 1e-6


def test_analytic_check_catches_broken_residuals(monkeypatch):
    """The same check fails for the classic bugs, so a pass means something."""
    g = torch.Generator().manual_seed(1)
    target = torch.randn(1, 16, generator=g) * 2
    pt = _processed(target, 1.0, 0, 1.0)[0]
    qd = _processed(target + torch.randn(1, 16, generator=g), 1.0, 0, 1.0)[0]
    good = V.residual_distribution
    # bug 1: resample from p instead of the residual
    monkeypatch.setattr(V, "residual_distribution", lambda p, q: p)
    assert 0.5 * (V.output_distribution(pt, qd) - pt.double()).abs().sum() > 0.01
    # bug 2: residual not renormalised
    monkeypatch.setattr(V, "residual_distribution", lambda p, q: (p - q).clamp_min(0))
    assert 0.5 * (V.output_distribution(pt, qd) - pt.double()).abs().sum() > 0.01
    monkeypatch.setattr(V, "residual_distribution", good)
    # bug 3: a draft processed differently from the target (raw vs top-k q)
    raw_q = _processed(target + 1, 1.0, 0, 1.0)[0]
    topk_p = _processed(target, 1.0, 4, 1.0)[0]
    assert 0.5 * (V.output_distribution(topk_p, raw_q) - pt.double()).abs().sum() > 0.01


def _run_verify(n, kmax, t, k, p, seed, draft_probs_mode="sampled", vocab=8):
    """n rows with mixed draft lengths against a position-dependent toy target."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(kmax + 1, vocab, generator=g) * 1.5  # p_i independent of history
    draft = target[:kmax] + torch.randn(kmax, vocab, generator=g)
    rows = RowSampling.full(n, t, k, p)
    logits = target.expand(n, -1, -1)
    q = probs_from_logits(draft.expand(n, -1, -1), rows)  # [n, kmax, V]
    seeds = torch.arange(n) + seed * 1_000_003
    counters = torch.arange(kmax).expand(n, -1)
    u_draft = rng.uniforms(seeds, counters, rng.DRAFT)
    if draft_probs_mode == "argmax":
        tokens = q.argmax(-1)
    else:
        tokens = torch.stack([sample_from_probs(q[:, i], u_draft[:, i]) for i in range(kmax)], 1)
    num_draft = torch.arange(n) % (kmax + 1)  # k = 0..kmax mixed in one batch
    qarg = {"sampled": q, "onehot": None, "argmax": q}[draft_probs_mode]
    out = V.verify(
        logits,
        tokens,
        num_draft,
        qarg,
        rows,
        rng.uniforms(seeds, counters, rng.ACCEPT),
        rng.uniforms(seeds, torch.arange(kmax + 1).expand(n, -1)),
    )
    p_pos = probs_from_logits(target.unsqueeze(0), rows[:1])[0]  # [kmax+1, V]
    return out, p_pos


def _position_pvalues(out, p_pos):
    pvals = []
    for i in range(p_pos.shape[0]):
        reached = out.num_emitted > i
        if reached.sum() < 1000:
            continue
        counts = torch.bincount(out.tokens[reached, i], minlength=p_pos.shape[1]).float()
        pvals.append(gof_pvalue(counts, p_pos[i]))
    return pvals


@pytest.mark.parametrize("t,k,p", SETTINGS)
@pytest.mark.parametrize("mode", ["sampled", "onehot"])
def test_monte_carlo_emitted_tokens_follow_the_target(t, k, p, mode):
    """120k rows; every position's emitted tokens pass a chi-square test at 1e-4."""
    out, p_pos = _run_verify(120_000, 3, t, k, p, seed=int(t * 10) + k, draft_probs_mode=mode)
    pvals = _position_pvalues(out, p_pos)
    assert len(pvals) >= 3 and min(pvals) > 1e-4, pvals


def test_monte_carlo_catches_argmax_drafts_scored_with_softmax_q():
    """The transformers#32867 bug: drafting by argmax but verifying against softmax q."""
    out, p_pos = _run_verify(120_000, 3, 1.0, 0, 1.0, seed=5, draft_probs_mode="argmax")
    assert min(_position_pvalues(out, p_pos)) < 1e-6


def test_monte_carlo_catches_residual_from_p(monkeypatch):
    monkeypatch.setattr(V, "residual_distribution", lambda p, q: p)
    out, p_pos = _run_verify(120_000, 3, 1.0, 0, 1.0, seed=6)
    assert min(_position_pvalues(out, p_pos)) < 1e-6


def test_hand_made_cases_greedy_and_edges():
    Vv = 6
    logits = torch.full((3, 4, Vv), -10.0)
    for b, best in enumerate([[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]]):
        for i, tok in enumerate(best):
            logits[b, i, tok] = 10.0
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [2, 2, 2]])
    num = torch.tensor([3, 3, 0])
    zeros = torch.zeros(3)
    out = V.verify(
        logits,
        drafts,
        num,
        None,
        RowSampling(zeros, torch.zeros(3, dtype=torch.long), torch.ones(3)),
        torch.zeros(3, 3, dtype=torch.float64),
        torch.zeros(3, 4, dtype=torch.float64),
    )
    assert out.tokens.tolist() == [[1, 2, 3, 4], [1, 2, -1, -1], [5, -1, -1, -1]]
    assert out.num_accepted.tolist() == [3, 1, 0]
    assert out.accepted.tolist() == [[True] * 3, [True, False, False], [False] * 3]


def test_zero_probability_draft_is_never_accepted_even_at_u_zero():
    logits = torch.tensor([[[0.0, 0.0, float("-inf")], [0.0, 0.0, 0.0]]])  # p(2) = 0
    q = torch.tensor([[[0.0, 0.0, 1.0]]])
    out = V.verify(
        logits,
        torch.tensor([[2]]),
        torch.tensor([1]),
        q,
        RowSampling.full(1, 1.0),
        torch.zeros(1, 1, dtype=torch.float64),
        torch.full((1, 2), 0.5, dtype=torch.float64),
    )
    assert out.num_accepted.item() == 0 and out.tokens[0, 0].item() in (0, 1)


def test_a_rows_verification_does_not_depend_on_its_batch_mates():
    """Same tokens, acceptances and log-probs for a row verified alone or in a mixed batch.

    Row 0 drafts a far-tail token (p ~ 2e-9 at T = 1, top_p = 1) with a tiny acceptance
    uniform: it is accepted alone, and must still be beside rows that use top-k / top-p.
    """
    from tests.test_sampling import MIXED_ROWS, row_params

    B, K, Vv = len(MIXED_ROWS), 3, 12
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(B, K + 1, Vv, generator=g) * 3
    logits[0] = 0.0
    logits[0, :, 0] = 20.0
    t, k, p = row_params(MIXED_ROWS)
    rows = RowSampling(t, k, p)
    q = probs_from_logits(logits[:, :K] + torch.randn(B, K, Vv, generator=g), rows)
    seeds = torch.arange(B)
    drafts = torch.stack(
        [sample_from_probs(q[:, i], rng.uniforms(seeds, torch.full((B,), i))) for i in range(K)], 1
    )
    drafts[0] = 1
    num_draft = torch.arange(B) % (K + 1)
    num_draft[0] = 1
    u_acc = rng.uniforms(seeds, torch.arange(K).expand(B, -1), rng.ACCEPT)
    u_acc[0] = 1e-10
    u_smp = rng.uniforms(seeds, torch.arange(K + 1).expand(B, -1))
    for probs in (q, None):
        out = V.verify(logits, drafts, num_draft, probs, rows, u_acc, u_smp)
        for b in range(B):
            s = slice(b, b + 1)
            one = V.verify(
                logits[s], drafts[s], num_draft[s], None if probs is None else probs[s],
                rows[s], u_acc[s], u_smp[s],
            )  # fmt: skip
            assert torch.equal(one.tokens, out.tokens[s]), MIXED_ROWS[b]
            assert torch.equal(one.accepted, out.accepted[s])
            assert torch.equal(one.logprobs, out.logprobs[s])
        if probs is None:
            assert out.num_accepted[0] == 1  # the far-tail draft survived the batch
