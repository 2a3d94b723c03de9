"""The learner runs an update's repeated prompts once (GRPO's groups) and trains exactly
as the plain forward of every row does: the same log-probs, statistics and gradients."""

from __future__ import annotations

import pytest
import torch

from specroll.rl.algo.batch import Batch
from specroll.rl.learner import shared_prompts
from tests.conftest import learner
from tests.test_learner import tiny_policy


def grouped_batch(vocab: int = 97, groups: int = 3, size: int = 4, seed: int = 0) -> Batch:
    """`size` rows per prompt (prompts of 3, 7, 11 ... tokens), responses of 1-20 tokens,
    rows shuffled, padded with random ids (a row that read its padding would show)."""
    g = torch.Generator().manual_seed(seed)
    rows, prompt_lens = [], []
    for i in range(groups):
        prompt = torch.randint(0, vocab, (3 + 4 * i,), generator=g).tolist()
        for _ in range(size):
            n = int(torch.randint(1, 21, (1,), generator=g))
            rows.append(prompt + torch.randint(0, vocab, (n,), generator=g).tolist())
            prompt_lens.append(len(prompt))
    order = torch.randperm(len(rows), generator=g).tolist()
    rows, prompt_lens = [rows[i] for i in order], [prompt_lens[i] for i in order]
    W = max(len(r) for r in rows)
    tokens = torch.randint(0, vocab, (len(rows), W), generator=g)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    b = Batch(tokens, torch.tensor(prompt_lens), lengths, torch.randn(len(rows), generator=g), None)
    b.behaviour_logp = -4.5 * torch.rand(tokens.shape, generator=g) * b.response_mask
    return b


def _trained(enabled: bool, monkeypatch, b: Batch, draft: bool, adapters: bool = False):
    from specroll.drafting.train import new_eagle3
    from tests.test_lora import _adapted

    monkeypatch.setattr(shared_prompts, "ENABLED", enabled)
    ran = []
    monkeypatch.setattr(
        shared_prompts.PromptPass, "backward", _counting(shared_prompts.PromptPass.backward, ran)
    )
    policy = _adapted(tiny_policy()) if adapters else tiny_policy()
    d = new_eagle3(policy, torch.arange(0, 97, 2), (1, 2, 3), 0) if draft else None
    lr = learner(policy, "rollout.temperature=0.8", draft=d)
    old = lr.logprobs(b) - 0.3 * b.response_mask  # (plain: the stage does not share)
    stats = lr.train(b, old)
    grads = [p.grad.clone() for p in policy.parameters() if p.requires_grad]
    dgrads = [p.grad.clone() for p in d.parameters()] if draft else []
    return stats, grads, dgrads, len(ran)


def _counting(fn, calls: list):
    def wrapped(self):
        calls.append(1)
        return fn(self)

    return wrapped


@pytest.mark.parametrize("draft,adapters", [(False, False), (True, False), (False, True)])
def test_an_update_over_shared_prompts_equals_the_plain_forwards(monkeypatch, draft, adapters):
    b = grouped_batch()
    s0, g0, d0, ran0 = _trained(False, monkeypatch, b, draft, adapters)
    s1, g1, d1, ran1 = _trained(True, monkeypatch, b, draft, adapters)
    assert (ran0, ran1) == (0, 1)  # the plain run shares nothing; the other shares once
    assert s0.keys() == s1.keys()
    for k in s0:
        if isinstance(s0[k], float):
            assert s1[k] == pytest.approx(s0[k], rel=1e-4, abs=1e-6), k
    for a, c in zip(g0 + d0, g1 + d1, strict=True):
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-6)
    assert s0["clip_frac"] > 0  # (the old log-probs were moved: a ratio that is not 1)


def test_shared_prompts_give_the_plain_forwards_logprobs(monkeypatch):
    """Per token, the head's log-probs over the shared prompts equal the plain forward's,
    prompt by prompt, including each response's first token (read from the prompt pass)."""
    b = grouped_batch(seed=1)
    policy = tiny_policy()
    lr = learner(policy)
    plan = lr._micro(b)
    pp = shared_prompts.PromptPass.of(policy, b, lr.hidden_layers, limit=10**6)
    assert pp is not None and len(set(pp.prompt_of)) == 3
    for m in plan:
        sub = b.rows(m.idx, m.width)
        where = m.where(sub, lr.device)
        plain = lr.forward(policy, sub, where=where)[0]
        shared = lr.forward(policy, sub, where=where, shared=(pp, m))[0]
        torch.testing.assert_close(shared, plain, rtol=0, atol=2e-6)


@pytest.mark.parametrize("exact", [False, True])
def test_stage_logprob_shares_prompts_and_gives_the_plain_logprobs(monkeypatch, exact):
    """Stage `logprob` (and the agreement check, `exact`: fp32 under a bf16 learner) runs
    the repeated prompts once and returns the plain forwards' log-probs, row by row."""
    b = grouped_batch(seed=2)
    lr = learner(tiny_policy(), "learner.dtype=bfloat16" if exact else "learner.dtype=float32")
    built = []
    of = shared_prompts.PromptPass.of.__func__

    def recorded(cls, *args):
        built.append(of(cls, *args))
        return built[-1]

    monkeypatch.setattr(shared_prompts.PromptPass, "of", classmethod(recorded))
    shared = lr.logprobs(b, exact=exact)
    monkeypatch.setattr(shared_prompts, "ENABLED", False)
    plain = lr.logprobs(b, exact=exact)
    assert built[0] is not None and built[1] is None  # shared, then plain
    torch.testing.assert_close(shared, plain, rtol=0, atol=2e-6)
    assert bool((plain != 0).any())


def test_distinct_prompts_or_too_many_run_the_plain_forward():
    policy = tiny_policy()
    b = grouped_batch(size=1)  # every prompt once: nothing to share
    assert shared_prompts.PromptPass.of(policy, b, (3,), limit=10**6) is None
    b = grouped_batch(size=2)
    assert shared_prompts.PromptPass.of(policy, b, (3,), limit=3 * 11 - 1) is None
    assert shared_prompts.PromptPass.of(policy, b, (3,), limit=3 * 11) is not None
