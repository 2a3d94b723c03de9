"""The rollout engine: what an RL learner relies on when it consumes rollouts."""

from __future__ import annotations

import pytest
import torch

from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.model import load_model


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (n,), generator=g)
    return [torch.randint(0, 97, (int(k),), generator=g).tolist() for k in lengths]


def _learner_logprobs(model, prompt, tokens, temperature, top_k=0, top_p=1.0):
    """What the learner computes: a full-sequence forward with autograd recording, and the
    log-probs of the processed distribution (tempered, truncated to top-k / top-p)."""
    from specroll.rl.algo.logprobs import truncated

    seq = torch.tensor([prompt + tokens])
    with torch.enable_grad():
        logits = model(seq).logits[0, len(prompt) - 1 : -1].detach()
    t = temperature if temperature > 0 else 1.0
    z = truncated(logits / t, top_k, top_p)
    return z.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


TINY_EPS_LOGIT = 2e-5
"""Engine-vs-learner logit bound of the tiny test models (measured <= 7e-6 on them; see
specroll.rl.algo.mismatch): a tighter check than the policy-wide EPS_LOGIT, so a regression of
a few ulps x depth in the engine's numerics still fails here."""


@pytest.mark.parametrize("variant", ["llama-tied", "qwen2-bias", "qwen3-qknorm"])
@pytest.mark.parametrize("mode", ["plain", "speculative"])
@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9), (0.45, 0, 1.0), (0.0, 0, 1.0)]
)
def test_engine_logprobs_equal_learner_recomputation(
    hf_dirs, variant, mode, temperature, top_k, top_p
):
    """Engine log-probs are within the stated bound of the learner's: 2 eps_logit / T.

    The two sides differ in fp32 rounding (cached vs full-sequence attention), a logit
    error that log_softmax(z / T) scales by 1 / T; at T = 1 plain rows still meet 1e-5.
    """
    from specroll.drafters.draft_model import DraftModelDrafter
    from specroll.engine.depth import FixedDepth
    from specroll.rl.algo.mismatch import logprob_tolerance

    model = load_model(hf_dirs[variant][1])
    prompts = _prompts(4)
    params = SamplingParams(temperature, top_k, top_p, max_new_tokens=40, stop_token_ids=(), seed=5)
    if mode == "plain":
        eng = Engine(model, EngineConfig(max_batch=4))
    else:  # the policy as its own draft: every emitted token comes from a verify forward
        eng = Engine(model, EngineConfig(max_batch=4), DraftModelDrafter(model), FixedDepth(3))
    results = eng.generate([Request(p, params) for p in prompts])
    if mode == "speculative":
        assert eng.stats.acceptance_length > 2
    err = 0.0
    for p, r in zip(prompts, results, strict=True):
        ref = _learner_logprobs(model, p, r.token_ids, temperature, top_k, top_p)
        err = max(err, float((ref - torch.tensor(r.logprobs)).abs().max()))
    assert err <= logprob_tolerance(temperature)  # the bound the pipeline warns on
    assert err <= logprob_tolerance(temperature, eps_logit=TINY_EPS_LOGIT)
    if mode == "plain" and temperature in (0.0, 1.0):
        assert err <= 1e-5  # untempered plain decoding meets the strict promise


def test_continuous_batching_is_invisible(tiny_model):
    """Each request's output is the same alone or among 15 others of other lengths."""
    prompts = _prompts(16, seed=3)
    lengths = [5 + 7 * (i % 5) for i in range(16)]  # different budgets → slots free early
    reqs = [
        Request(
            p, SamplingParams(temperature=1.0, max_new_tokens=n, seed=100 + i, stop_token_ids=())
        )
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    alone = [Engine(tiny_model).generate([r])[0] for r in reqs]
    for max_batch in (16, 5):  # all at once, and with slot reuse / compaction
        batched = Engine(tiny_model, EngineConfig(max_batch=max_batch)).generate(reqs)
        for a, b, n in zip(alone, batched, lengths, strict=True):
            assert a.token_ids == b.token_ids
            assert b.finish_reason == "length" and len(b.token_ids) == n
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    # order of submission does not matter either
    perm = list(reversed(reqs))
    for a, b in zip(
        reversed(alone), Engine(tiny_model, EngineConfig(max_batch=7)).generate(perm), strict=True
    ):
        assert a.token_ids == b.token_ids


def test_seeded_determinism_and_greedy_ignores_seed(tiny_model):
    p = _prompts(1)[0]
    eng = Engine(tiny_model)

    def run(temperature, seed):
        params = SamplingParams(temperature, max_new_tokens=30, seed=seed, stop_token_ids=())
        return eng.generate([Request(p, params)])[0].token_ids

    assert run(1.0, 7) == run(1.0, 7)
    assert run(1.0, 7) != run(1.0, 8)
    assert run(0.0, 7) == run(0.0, 8)
    # unseeded requests draw seeds from the engine seed, reproducibly
    reqs = [Request(p, SamplingParams(max_new_tokens=10, stop_token_ids=()))] * 3
    a = Engine(tiny_model, EngineConfig(seed=1)).generate(reqs)
    b = Engine(tiny_model, EngineConfig(seed=1)).generate(reqs)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert len({r.seed for r in a}) == 3


def test_stop_tokens_length_and_context_limits(tiny_model):
    p = _prompts(1)[0]
    eng = Engine(tiny_model)
    free = eng.generate([Request(p, SamplingParams(0.0, max_new_tokens=50, stop_token_ids=()))])
    toks = free[0].token_ids
    assert free[0].finish_reason == "length" and len(toks) == 50
    stop = toks[10]
    first = toks.index(stop)
    r = eng.generate([Request(p, SamplingParams(0.0, max_new_tokens=50, stop_token_ids=(stop,)))])
    assert r[0].finish_reason == "stop"
    assert r[0].token_ids == toks[: first + 1]  # the stop token is part of the sample
    # context window of 256: a 250-token prompt can produce 6 tokens at most
    long = (p * 256)[:250]
    r = eng.generate([Request(long, SamplingParams(1.0, max_new_tokens=50, stop_token_ids=()))])
    assert r[0].finish_reason == "context" and len(r[0].token_ids) == 6
    # max_new_tokens=1 finishes at prefill
    r = eng.generate([Request(p, SamplingParams(1.0, max_new_tokens=1))])
    assert len(r[0].token_ids) == 1 and r[0].finish_reason in ("length", "stop")


def test_results_carry_timing_and_ids(tiny_model):
    reqs = [
        Request(q, SamplingParams(max_new_tokens=5), request_id=f"r{i}")
        for i, q in enumerate(_prompts(3))
    ]
    res = Engine(tiny_model).generate(reqs)
    assert [r.request_id for r in res] == ["r0", "r1", "r2"]
    for r in res:
        assert 0 < r.first_token_s <= r.latency_s
        assert len(r.logprobs) == len(r.token_ids) and all(lp <= 0 for lp in r.logprobs)


def test_load_weights_versions_results_and_refuses_foreign_tensors(tiny_model):
    """Weight sync through the engine's own API: the tensors land in place (a fresh
    engine on the same weights samples the same tokens), every result carries the
    version, the call's stats come back with its results, and a mismatch names what is
    wrong without stamping the new version."""
    import copy

    from specroll.drafters.ngram import NgramDrafter

    reqs = [Request(q, SamplingParams(max_new_tokens=6, seed=i)) for i, q in enumerate(_prompts(4))]
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    eng = Engine(copy.deepcopy(tiny_model), drafter=NgramDrafter())
    eng.load_weights(3, {k: v.detach() for k, v in other.state_dict().items()})
    out = eng.generate(reqs)
    fresh = Engine(other, drafter=NgramDrafter()).generate(reqs)
    assert [r.token_ids for r in out] == [r.token_ids for r in fresh]
    assert {(r.policy_version, r.draft_version) for r in out} == {(3, 3)}
    # decode iterations emit every token but each row's first (prefill samples that one)
    assert out.stats.drafts > 0
    assert out.stats.emitted_tokens == sum(len(r.token_ids) - 1 for r in out)
    with pytest.raises(ValueError, match="names differ"):
        eng.load_weights(4, {"nonsense": torch.zeros(1)})
    with pytest.raises(ValueError, match="draft weights given"):
        eng.load_weights(4, other.state_dict(), {"w": torch.zeros(1)})  # n-gram has none
    assert eng.policy_version == 3


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(seed=-1), r"seed must be an integer in \[0, 2\*\*62\)"),
        (dict(seed=2**62), r"seed must be an integer in \[0, 2\*\*62\)"),
        (dict(seed=2**63), r"seed must be an integer in \[0, 2\*\*62\)"),
        (dict(seed=1.5), "seed must be an integer"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_every_valid_seed_generates_and_seeds_never_alias(tiny_model):
    """The extreme seeds run (no int64 overflow), distinct seeds give distinct streams,
    and the engine's own seeds (params.seed = None) lie in the same range."""
    from specroll.spec import rng

    p = _prompts(1)[0]
    eng = Engine(tiny_model)
    edge = [0, 1, 2**61, 2**62 - 1]
    params = [SamplingParams(1.0, max_new_tokens=12, seed=s, stop_token_ids=()) for s in edge]
    res = eng.generate([Request(p, sp) for sp in params])
    assert [r.seed for r in res] == edge
    assert len({tuple(r.token_ids) for r in res}) == len(edge)
    # (seed, stream) -> key is injective: no two pairs share their first uniforms
    seeds = torch.tensor(edge + [2**62 - 2, 2**60 + 7, 12345])
    firsts = torch.stack(
        [rng.uniforms(seeds, torch.arange(4).expand(7, -1), s) for s in range(rng.NUM_STREAMS)]
    )  # [streams, seeds, 4]
    assert len({tuple(row.tolist()) for row in firsts.flatten(0, 1)}) == 7 * rng.NUM_STREAMS
    drawn = Engine(tiny_model, EngineConfig(seed=3)).generate(
        [Request(p, SamplingParams(max_new_tokens=2))] * 64
    )
    assert all(0 <= r.seed < rng.SEED_LIMIT for r in drawn)
    for r in drawn[:4]:  # an engine-drawn seed is a valid SamplingParams seed
        SamplingParams(seed=r.seed)


def test_bad_requests_and_models_fail_clearly(tiny_model, tmp_path, hf_dirs):
    eng = Engine(tiny_model)
    assert eng.generate([]) == []
    with pytest.raises(ValueError, match="context window"):
        eng.generate([Request([1] * 256)])
    with pytest.raises(ValueError, match="empty"):
        eng.generate([Request([])])
    with pytest.raises(ValueError, match=r"\[0, 97\)"):
        eng.generate([Request([5, 97])])
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")
    import shutil

    bad = tmp_path / "corrupt"
    shutil.copytree(hf_dirs["llama-tied"][1], bad)
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ValueError, match="corrupt"):
        load_model(bad)
    with pytest.raises(ValueError):
        EngineConfig(max_batch=0)


def test_request_seeds_and_prompt_checks_are_the_engines(tiny_model):
    """`request_seeds` draws what the engine gives requests without a seed (one draw per
    request from a CPU generator on the engine seed, below 2**62) and keeps the others';
    `check_prompts` names the first bad request."""
    from specroll.engine.request import check_prompts, request_seeds

    p = _prompts(1)[0]
    reqs = [
        Request(p, SamplingParams(max_new_tokens=2, seed=None if i % 3 else 77 + i))
        for i in range(7)
    ]
    gen = torch.Generator().manual_seed(11)
    draws = [int(torch.randint(0, 2**62, (1,), generator=gen)) for _ in reqs]
    want = [d if r.params.seed is None else r.params.seed for d, r in zip(draws, reqs, strict=True)]
    assert request_seeds(reqs, 11) == want
    got = Engine(tiny_model, EngineConfig(seed=11)).generate(reqs)
    assert [r.seed for r in got] == want
    check_prompts(reqs, 256, 97)
    with pytest.raises(ValueError, match=r"request 2: prompt_ids must be in \[0, 50\)"):
        check_prompts([Request([1]), Request([2]), Request([3, 60])], 256, 50)
    with pytest.raises(ValueError, match="request 1: prompt of 8 tokens"):
        check_prompts([Request([1]), Request([1] * 8)], 8, 97)


def test_collection_passes_while_generating_skip_the_heap_and_nothing_leaks(tiny_model):
    """While the engine generates, objects alive before the call are frozen (the
    collector's passes in the loop skip them: `engine.heap`); afterwards they are not,
    and cyclic garbage made before the call is still collected."""
    import gc

    class Cycle:
        pass

    def cycles(n: int) -> None:
        for _ in range(n):
            a, b = Cycle(), Cycle()
            a.b, b.a = b, a

    gc.collect()
    cycles(50)  # garbage, collectable only by the cyclic collector
    frozen_inside = []
    params = SamplingParams(1.0, max_new_tokens=4, seed=1)
    Engine(tiny_model, EngineConfig(max_batch=2)).generate(
        [Request([1, 2, 3], params)] * 2,
        on_progress=lambda *_: frozen_inside.append(gc.get_freeze_count()),
    )
    assert frozen_inside and min(frozen_inside) > 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert not any(isinstance(o, Cycle) for o in gc.get_objects())

    # an application's own frozen heap is left frozen
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        Engine(tiny_model, EngineConfig(max_batch=2)).generate([Request([1, 2, 3], params)])
        assert gc.get_freeze_count() == before
    finally:
        gc.unfreeze()
