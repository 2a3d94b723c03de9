"""The verifier is exact: analytically (TV < 1e-6) and by Monte-Carlo tests that can fail."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import specroll.spec.verify as V
from specroll.spec import rng
from specroll.spec.sampling import RowSampling, probs_from_logits, sample_from_probs

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


ENUM_CASES = [  # (vocabulary, drafts kmax, temperature, top_k, top_p)
    (3, 1, 1.0, 0, 1.0),
    (4, 2, 0.7, 0, 1.0),
    (5, 2, 1.3, 2, 1.0),
    (5, 2, 1.0, 0, 0.8),
    (4, 2, 0.7, 3, 0.9),
]
MARGIN = 1e-5
"""Relative margin of the acceptance uniforms around each threshold min(1, p/q): wider
than the fp32 rounding of the verifier's own p (~1e-7), so its decision is the branch's."""


def _breakpoints(*dists: torch.Tensor) -> torch.Tensor:
    """Sorted CDF breakpoints of every distribution in `dists` (0 and 1 included): on
    each interval between two of them, inverting the CDF of any of them gives one token."""
    cuts = [torch.tensor([0.0, 1.0], dtype=torch.float64)]
    for d in dists:
        c = d.double().cumsum(-1)
        cuts.append(c / c[-1])
    return torch.cat(cuts).clamp(0, 1).unique()


def _chain_law(nv, K, t, k, p, seed, mode, monkeypatch=None):
    """Exact laws of K + 1 tokens from one `verify` call, per (draft length, drafts).

    The target: random logits for every prefix of up to K tokens (so p_j depends on the
    drafts before j, as a real model's does). Rows of k = 0..K drafts sit side by side
    in one batch. For each row the law is integrated exactly over its uniforms: every
    draft sequence x (weighted by q(x) for sampled drafts), every acceptance outcome
    (accept the first a drafts, reject the next: probability prod min(1, p/q) times
    1 - min(1, p/q), taken with u_accept just inside that branch), and every interval
    between the CDF breakpoints of the distributions the row could draw its last token
    from (p_j and the residual at each j: the interval's length is its probability, its
    midpoint the u_sample). The verifier decides the branch and draws the token; the
    tokens it emits are continued by plain decoding up to K + 1 tokens.

    Returns (reference [nv] * (K + 1) float64, {(k, x): law}) where x = () for sampled drafts
    (the law summed over them) and each draft tuple for one-hot or argmax drafts.
    """
    g = torch.Generator().manual_seed(seed)
    tables = [torch.randn(nv**j, nv, generator=g) * 1.5 for j in range(K + 1)]  # logits
    # float64 laws summing to 1: the verifier holds them rounded to fp32, which moves its
    # thresholds and CDF breakpoints by ~1e-7, well inside MARGIN and every interval
    P = [probs_from_logits(L, RowSampling.full(len(L), t, k, p)).double() for L in tables]
    P = [x / x.sum(-1, keepdim=True) for x in P]
    Q = []  # the draft's q_j(. | x_<j): random, each row with a zero entry
    for j in range(K):
        q = torch.rand(nv**j, nv, generator=g, dtype=torch.float64) ** 2
        q[torch.arange(nv**j), torch.randint(0, nv, (nv**j,), generator=g)] = 0.0
        Q.append(q / q.sum(-1, keepdim=True))
    ref = torch.ones([nv] * 0, dtype=torch.float64)
    for j in range(K + 1):
        ref = ref.unsqueeze(-1) * P[j].view(*([nv] * j), nv)

    def pre(x):  # row index of the prefix x in the tables of its length
        return sum(v * nv ** (len(x) - 1 - i) for i, v in enumerate(x))

    rows = []  # (key, weight, drafts, n_draft, u_accept, u_sample)
    for n in range(K + 1):
        for x in itertools.product(range(nv), repeat=n):
            if mode == "sampled":
                key, w_x = (n, ()), math.prod(Q[j][pre(x[:j]), x[j]].item() for j in range(n))
            else:
                key, w_x = (n, x), 1.0
            if mode == "argmax":
                w_x = float(all(x[j] == Q[j][pre(x[:j])].argmax() for j in range(n)))
            if w_x == 0:
                continue
            p_at = [P[j][pre(x[:j])] for j in range(n + 1)]
            q_at = [
                Q[j][pre(x[:j])] if mode != "onehot" else torch.eye(nv, dtype=torch.float64)[x[j]]
                for j in range(n)
            ]
            residuals = [V.residual_distribution(a, b) for a, b in zip(p_at[:n], q_at, strict=True)]
            grid = _breakpoints(*p_at, *residuals)
            # min(1, p/q) (0 where q = 0), computed here, not by the verifier's function
            ratio = [
                min(1.0, p_at[j][x[j]].item() / q_at[j][x[j]].item()) if q_at[j][x[j]] > 0 else 0.0
                for j in range(n)
            ]
            for a in range(n + 1):  # drafts accepted
                w = w_x * math.prod(ratio[:a]) * (1.0 - ratio[a] if a < n else 1.0)
                if w == 0:
                    continue
                u_acc = [r * (1 - MARGIN) for r in ratio[:a]]
                if a < n:
                    u_acc.append(min(ratio[a] * (1 + MARGIN), 1 - 2**-53))
                u_acc += [0.5] * (K - len(u_acc))
                for lo, hi in zip(grid[:-1].tolist(), grid[1:].tolist(), strict=True):
                    rows.append(
                        (key, w * (hi - lo), list(x) + [0] * (K - n), n, u_acc, (lo + hi) / 2)
                    )
    R = len(rows)
    drafts = torch.tensor([r[2] for r in rows]).view(R, K)
    logits = torch.stack(
        [torch.stack([tables[j][pre(r[2][:j])] for j in range(K + 1)]) for r in rows]
    )
    probs = None
    if mode != "onehot":
        probs = torch.stack(
            [torch.stack([Q[j][pre(r[2][:j])] for j in range(K)]) for r in rows]
        ).float()
    out = V.verify(
        logits,
        drafts,
        torch.tensor([r[3] for r in rows]),
        probs,
        RowSampling.full(R, t, k, p),
        torch.tensor([r[4] for r in rows], dtype=torch.float64).view(R, K),
        torch.tensor([r[5] for r in rows], dtype=torch.float64).unsqueeze(1).expand(R, K + 1),
    )
    laws: dict = {}
    for r, toks, m in zip(rows, out.tokens.tolist(), out.num_emitted.tolist(), strict=True):
        e = tuple(toks[:m])
        law = laws.setdefault(r[0], torch.zeros([nv] * (K + 1), dtype=torch.float64))
        before = ref[e].sum() if m <= K else ref[e]
        assert before > 0, f"emitted {e}, a sequence of probability zero"
        law[e] += r[1] * ref[e] / before  # continued by plain decoding
    return ref, laws


@pytest.mark.parametrize("nv,K,t,k,p", ENUM_CASES)
@pytest.mark.parametrize("mode", ["sampled", "onehot"])
def test_chain_verification_emits_exactly_the_target_law(nv, K, t, k, p, mode):
    """Exact, no sampling: for every draft length 0..K (side by side in one batch) and,
    for one-hot drafts, every proposed sequence, the law of K + 1 tokens (the row's
    emitted tokens continued by plain decoding) is the target's to 1e-12 in float64.
    By induction over iterations, every sequence the verifier emits is a draw from p."""
    ref, laws = _chain_law(nv, K, t, k, p, seed=nv * 10 + K, mode=mode)
    assert len(laws) == (K + 1 if mode == "sampled" else sum(nv**n for n in range(K + 1)))
    for key, law in laws.items():
        assert (law - ref).abs().max() < 1e-12, (key, (law - ref).abs().max().item())


def test_the_exact_law_catches_broken_verifiers_and_drafts(monkeypatch):
    """The same enumeration departs from the target by > 1e-3 when the recovered token is
    drawn from p instead of the residual, when acceptance ignores q (u < p rather than
    u < p/q), or when drafts are the argmax of the q handed to the verifier
    (transformers#32867): a pass means something."""
    case = (4, 2, 1.0, 0, 1.0)

    def worst(mode="sampled"):
        ref, laws = _chain_law(*case, seed=3, mode=mode)
        return max((law / law.sum() - ref).abs().max().item() for law in laws.values())

    assert worst() < 1e-12
    assert worst("argmax") > 1e-3
    good_residual, good_ratio = V.residual_distribution, V.acceptance_ratio
    monkeypatch.setattr(V, "residual_distribution", lambda p_, q_: p_)
    assert worst() > 1e-3
    monkeypatch.setattr(V, "residual_distribution", good_residual)
    monkeypatch.setattr(V, "acceptance_ratio", lambda px, qx: good_ratio(px, torch.ones_like(qx)))
    assert worst() > 1e-3


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
