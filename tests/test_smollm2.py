"""The real embedded default (SmolLM2-135M-Instruct): parity with transformers (slow)."""

from __future__ import annotations

import pytest
import torch

from specroll.model import KVCache, load_model
from specroll.model.hub import resolve
from specroll.model.tokenizer import Tokenizer
from tests.conftest import assert_greedy_matches_hf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    import transformers

    path = resolve("smollm2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(path), hf, Tokenizer(path)


def test_logits_and_incremental_decode_match_transformers(smollm2):
    ours, hf, tok = smollm2
    ids = torch.tensor([tok.encode_prompt("Explain why the sky is blue, step by step.")])
    with torch.no_grad():
        ref = hf(ids).logits
        full = ours(ids).logits
        assert (ref - full).abs().max() <= 1e-4
        cache = KVCache(ours.cfg, 1, 128)
        n = ids.shape[1] - 5
        ours(ids[:, :n], positions=torch.zeros(1, dtype=torch.long), cache=cache)
        for i in range(n, ids.shape[1]):
            step = ours(ids[:, i : i + 1], positions=torch.tensor([i]), cache=cache).logits
            assert (step[0, 0] - ref[0, i]).abs().max() <= 1e-4


def test_greedy_generation_matches_transformers(smollm2):
    ours, hf, tok = smollm2
    texts = ("What is 7 times 8?", "Name three colours.")
    assert_greedy_matches_hf(ours, hf, [tok.encode_prompt(t) for t in texts])
