"""A prompt repeated within a `generate` call (GRPO's group) is prefilled once; every row
still samples what it would have sampled with its prompt computed for it alone."""

from __future__ import annotations

import pytest
import torch

from specroll.engine import Engine, EngineConfig, Request, SamplingParams, prompt_reuse
from specroll.engine.depth import FixedDepth
from tests.conftest import PROMPT, spec_drafters, spec_model


def _group_requests(prompts: list[list[int]], group: int, new_tokens: int) -> list[Request]:
    """`group` requests per prompt, adjacent (as an RL step submits them), seeds distinct."""
    return [
        Request(
            p, SamplingParams(1.0, max_new_tokens=new_tokens, seed=10 * i + j, stop_token_ids=())
        )
        for i, p in enumerate(prompts)
        for j in range(group)
    ]


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 97, (4 + 5 * i,), generator=g).tolist() for i in range(n)]


def test_a_group_prefills_its_prompt_once_and_every_row_samples_as_if_alone(tiny_model):
    reqs = _group_requests(_prompts(3), group=4, new_tokens=12)
    alone = [Engine(tiny_model).generate([r])[0] for r in reqs]
    # all rows in one prefill; and 5 slots, so that later rows copy what earlier calls left
    for max_batch in (12, 5):
        out = Engine(tiny_model, EngineConfig(max_batch=max_batch)).generate(reqs)
        assert out.stats.prompts_reused == 9, max_batch
        for a, b in zip(alone, out, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    # rows of one prompt sample apart: the copies are their own rows, not one row's echo
    assert len({tuple(r.token_ids) for r in alone[:4]}) > 1


def test_copies_dropped_for_room_are_computed_again(tiny_model, monkeypatch):
    reqs = _group_requests(_prompts(2), group=3, new_tokens=6)
    monkeypatch.setattr(prompt_reuse, "REUSE_SHARE", 1)  # room for both prompts' copies
    kept = Engine(tiny_model, EngineConfig(max_batch=1)).generate(reqs)
    assert kept.stats.prompts_reused == 4
    monkeypatch.setattr(prompt_reuse, "REUSE_SHARE", 10**12)  # room for no copy
    again = Engine(tiny_model, EngineConfig(max_batch=1)).generate(reqs)
    assert again.stats.prompts_reused == 0
    assert [r.token_ids for r in again] == [r.token_ids for r in kept]


@pytest.mark.parametrize("drafter", ["eagle3", "draft_model"])
def test_drafters_fed_from_copied_prompts_speculate_as_if_alone(drafter):
    """EAGLE-3 reads the prompt's hidden states from the copies; a draft model prefills
    its own cache: with per-request seeds either draws the same tokens as alone."""
    target = spec_model(0)
    make = spec_drafters(target)[drafter]
    prompts = [PROMPT, PROMPT[:5] + [1, 1]]
    reqs = _group_requests(prompts, group=3, new_tokens=10)

    def run(rs, max_batch):
        eng = Engine(target, EngineConfig(max_batch=max_batch), make(), FixedDepth(3))
        return eng.generate(rs)

    alone = [run([r], 1)[0].token_ids for r in reqs]
    for max_batch in (6, 4):
        out = run(reqs, max_batch)
        assert out.stats.prompts_reused == 4
        assert out.stats.draft_tokens > 0
        assert [r.token_ids for r in out] == alone
