"""Evaluate a draft where it will be used: speculative rollouts of held-out prompts.

Acceptance length, per-position acceptance and speed-up over plain decoding, for each
draft depth k and batch size, all measured in one process on the same requests and seeds
(`engine.bench.compare_spec`). The prompts come from the same set as the training data
but from another seed, so they are held out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specroll.drafters.base import Drafter
from specroll.engine.bench import compare_spec
from specroll.engine.request import Request, SamplingParams
from specroll.model.transformer import Transformer
from specroll.tasks.sets import encode, prompt_set

EVAL_SEED = 1
"""Prompt-set seed of evaluation prompts (training data uses seed 0 by default)."""


def eval_draft(
    policy: Transformer,
    tok,
    drafters: dict[str, Drafter],
    prompts: str = "math",
    n: int = 32,
    ks: tuple[int, ...] = (1, 3, 5, 7),
    batches: tuple[int, ...] = (1, 4),
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    repeats: int = 3,
    seed: int = EVAL_SEED,
    log: Callable[[str], None] = print,
) -> dict:
    """Speculative vs plain decoding of `n` held-out prompts of set `prompts`."""
    if n < 1 or repeats < 1:
        raise ValueError(f"n and repeats must be >= 1, got n={n}, repeats={repeats}")
    ids = [encode(tok, p) for p in prompt_set(prompts, n, seed)]
    reqs = [
        Request(p, SamplingParams(temperature, max_new_tokens=max_new_tokens, seed=1000 + i))
        for i, p in enumerate(ids)
    ]
    rows = []
    for B in batches:
        rows += compare_spec(policy, reqs, drafters, B, list(ks), repeats, log)
    return {
        "bench": "draft_eval",
        "prompts": prompts,
        "n": n,
        "seed": seed,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
