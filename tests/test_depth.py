"""Depth policies: the adaptive choice follows cost and acceptance; outputs never change."""

from __future__ import annotations

import pytest
import torch

from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine.depth import AdaptiveDepth, FixedDepth
from specroll.sim.costmodel import CostModel, fit_linear, fit_target


def test_expected_tokens_and_online_acceptance():
    d = AdaptiveDepth(CostModel(fixed=1.0), k_max=3, prior=0.5, prior_weight=1e-9)
    # 4 rows drafted 3 tokens: accepted prefixes of length 3, 1, 0, 2
    acc = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    d.observe(torch.tensor([3, 3, 3, 3]), acc)
    assert d.alphas().tolist() == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert d.expected_tokens(3) == pytest.approx(1 + 0.75 + 0.5 + 0.25)
    assert d.expected_tokens(0) == 1.0


def test_adaptive_picks_deep_when_verification_is_free_and_zero_when_it_is_not():
    cheap = CostModel(fixed=0.01, per_token=1e-6, knee=64, draft_step=1e-4)
    hi = AdaptiveDepth(cheap, k_max=5, prior=0.8)
    assert hi.choose(1) == 5
    costly = CostModel(fixed=0.0, per_token=0.01, knee=1, draft_step=1e-3)  # linear in tokens
    assert AdaptiveDepth(costly, k_max=5, prior=0.8).choose(8) == 0
    # a draft that is never accepted switches speculation off (drafting costs 20%)
    d = AdaptiveDepth(CostModel(fixed=0.01, draft_step=2e-3), k_max=5, prior=0.8, decay=1.0)
    assert d.choose(1) >= 3  # before any evidence: the prior says drafting pays
    for _ in range(50):
        d.observe(torch.full((4,), 5), torch.zeros(4, 5, dtype=torch.bool))
    assert d.choose(1) == 0


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


def test_cached_profile_is_measured_once_and_remeasured_when_stale(
    tiny_model, tmp_path, monkeypatch
):
    from specroll.drafters.ngram import NgramDrafter
    from specroll.sim import profile as P

    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))
    calls = []

    def fake(model, drafter, prompts, **kw):
        calls.append(1)
        return CostModel(fixed=len(calls) * 1e-3, meta={"format": P.FORMAT})

    monkeypatch.setattr(P, "profile", fake)
    d = NgramDrafter()
    first = P.cached_profile(tiny_model, d, [[1, 2, 3]], log=lambda m: None)
    again = P.cached_profile(tiny_model, d, [[1, 2, 3]], log=lambda m: None)
    assert len(calls) == 1 and again == first
    (path,) = (tmp_path / "profiles").iterdir()
    stale = CostModel.load(path)
    stale.meta = {"format": P.FORMAT - 1}
    stale.save(path)
    P.cached_profile(tiny_model, d, [[1, 2, 3]], log=lambda m: None)
    assert len(calls) == 2
    given = P.cached_profile(tiny_model, d, [], path=str(path), log=lambda m: None)
    assert given.fixed == 2e-3


def test_adaptive_probes_again_after_an_unlucky_start():
    """A few early rejections push the estimate below break-even; without evidence the
    counts relax to the prior, so drafting is tried again (and then kept, if it pays)."""
    cm = CostModel(fixed=0.01, per_token=1e-3, knee=1, draft_step=1e-3)  # k=1 pays if a > 0.2
    d = AdaptiveDepth(cm, k_max=1, prior=0.5, prior_weight=4.0, decay=0.95)
    assert d.choose(1) == 1  # the prior says drafting pays
    for _ in range(20):  # unlucky: a run of rejected drafts
        d.observe(torch.ones(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.bool))
    assert d.choose(1) == 0
    waited = next(i for i in range(200) if d.choose(1) == 1)
    assert 0 < waited < 100
    costly = CostModel(fixed=0.0, per_token=0.01, knee=1, draft_step=1e-3)
    e = AdaptiveDepth(costly, k_max=3, prior=0.5)
    assert all(e.choose(32) == 0 for _ in range(300))  # no probing where it cannot pay
