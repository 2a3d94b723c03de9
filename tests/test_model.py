"""The model core matches transformers exactly enough for RL (fp32, tiny random models)."""

from __future__ import annotations

import pytest
import torch

from specroll.model import KVCache, ModelConfig, load_model, save_model
from tests.conftest import VARIANTS, assert_greedy_matches_hf

pytestmark = pytest.mark.parametrize("variant", list(VARIANTS))


def _ours(hf_dirs, variant):
    return hf_dirs[variant][0], load_model(hf_dirs[variant][1])


def test_full_sequence_logits_match_transformers(hf_dirs, variant):
    hf, ours = _ours(hf_dirs, variant)
    x = torch.randint(0, 97, (3, 50), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(x, output_hidden_states=True)
        out = ours(x, hidden_layers=(0, 1, 2))
    assert (ref.logits - out.logits).abs().max() <= 1e-4
    # hidden states: residual stream after i layers (HF's last one is post-norm, skip it)
    for i in (0, 1):
        assert (ref.hidden_states[i] - out.hidden[i]).abs().max() <= 1e-4


def test_incremental_decode_equals_full_sequence(hf_dirs, variant):
    _, ours = _ours(hf_dirs, variant)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 97, (3, 40), generator=g)
    with torch.no_grad():
        full = ours(x).logits  # [3, 40, V]
        cache = KVCache(ours.cfg, 3, 64)
        # rows advance by different amounts: prefill 10/13/7 tokens, then 1..3 at a time
        lengths = torch.tensor([10, 13, 7])
        width = int(lengths.max())
        first = ours(
            x[:, :width],
            positions=torch.zeros(3, dtype=torch.long),
            cache=cache,
            logits_index=(lengths - 1).unsqueeze(1),
        ).logits[:, 0]
        for b in range(3):
            assert (first[b] - full[b, lengths[b] - 1]).abs().max() <= 1e-4
        pos = lengths.clone()
        steps = torch.tensor([1, 3, 2])
        while int((pos + steps).max()) <= 40:
            q = int(steps.max())
            idx = (pos.unsqueeze(1) + torch.arange(q)).clamp(max=39)
            toks = x.gather(1, idx)
            logits = ours(toks, positions=pos, cache=cache).logits
            for b in range(3):
                n = int(steps[b])
                ref = full[b, pos[b] : pos[b] + n]
                assert (logits[b, :n] - ref).abs().max() <= 1e-4
            pos = pos + steps


def test_greedy_generation_matches_transformers_generate(hf_dirs, variant):
    hf, ours = _ours(hf_dirs, variant)
    assert_greedy_matches_hf(ours, hf, [[5, 17, 33, 2], [90, 1, 4, 4, 4, 8, 9], [60]])


def test_save_roundtrip_loads_in_transformers(hf_dirs, variant, tmp_path):
    import transformers

    _, ours = _ours(hf_dirs, variant)
    save_model(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    again = load_model(tmp_path)
    x = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        a, b, c = ours(x).logits, back(x).logits, again(x).logits
    assert (a - b).abs().max() <= 1e-4
    assert torch.equal(a, c)
    assert ModelConfig.from_hf(back.config.to_dict()) == ours.cfg


def test_packed_inference_weights_follow_weight_updates(hf_dirs, variant):
    """The engine's prepacked weights never go stale after an optimizer step."""
    _, ours = _ours(hf_dirs, variant)
    x = torch.randint(0, 97, (2, 12))

    def both():
        with torch.no_grad():
            fast = ours(x).logits
        with torch.enable_grad():
            ref = ours(x).logits.detach()
        return fast, ref

    fast, ref = both()
    assert (fast - ref).abs().max() <= 1e-5
    with torch.no_grad():
        ours.layers[0].w_down.mul_(1.5)  # in place, as an optimizer would
        ours.head_weight.add_(0.01)
    fast2, ref2 = both()
    assert (fast2 - ref2).abs().max() <= 1e-5
    assert (fast2 - fast).abs().max() > 1e-3


def test_bf16_engine_numerics_match_transformers_bf16(hf_dirs, variant):
    """A bf16 model (weights and KV cache in bf16, RoPE tables kept fp32, norms as HF
    computes them) gives fp32 logits no further from the fp32 model's than transformers'
    own bf16 model is, through both the cached (engine) and the full-sequence path."""
    import transformers

    from specroll.model.weights import for_inference

    path = hf_dirs[variant][1]
    ref_model = load_model(path)
    ours = for_inference(load_model(path), "cpu", torch.bfloat16)
    assert ours.rotary.cos.dtype == torch.float32 and ours.layers[0].wqkv.dtype == torch.bfloat16
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(x).logits
        out = ours(x).logits
        theirs = hf(x).logits.float()
        cache = KVCache(ours.cfg, 3, 48, dtype=torch.bfloat16)
        zeros = torch.zeros(3, dtype=torch.long)
        first = ours(x[:, :30], positions=zeros, cache=cache).logits
        rest = ours(x[:, 30:], positions=torch.full((3,), 30), cache=cache).logits
    assert out.dtype == torch.float32 and first.dtype == torch.float32
    hf_err = float((theirs - ref).abs().max())
    scale = float(ref.abs().max())
    for got in (out, torch.cat([first, rest], dim=1)):
        assert float((got - ref).abs().max()) <= 2 * hf_err + 1e-3 * scale
        assert float((got - theirs).abs().max()) <= 0.05 * scale
