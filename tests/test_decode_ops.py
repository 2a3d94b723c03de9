"""The decode step's lean ops compute transformers' arithmetic bit for bit.

The engine's log-probs are the learner's old log-probs, and seeded rollouts must
reproduce across versions: a faster formulation of a norm, the rotation or the cache
write may only change how many kernels run, never a bit of the result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specroll.model import KVCache, ModelConfig
from specroll.model.ops import Rotary, apply_rotary, rms_norm


def _rotate_half_reference(x, cos, sin):
    """transformers' apply_rotary_pos_emb for one tensor, on its unsigned sin table."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def test_grad_free_rms_norm_is_f_rms_norm_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 1, 576), (4, 1, 576), (32, 1, 576), (3, 17, 64), (2, 5, 9, 64)]:
        x = torch.randn(shape, generator=g) * 3.0
        w = torch.randn(shape[-1], generator=g)
        with torch.no_grad():
            assert torch.equal(rms_norm(x, w, 1e-5), F.rms_norm(x, (shape[-1],), w, 1e-5))
            assert torch.equal(rms_norm(x, None, 1e-6), F.rms_norm(x, (shape[-1],), None, 1e-6))
            strided = x.transpose(0, -2)  # a non-contiguous view (as q/k are of qkv)
            want = F.rms_norm(strided, (shape[-1],), w, 1e-5)
            assert torch.equal(rms_norm(strided, w, 1e-5), want)
    # with autograd the learner's path: F.rms_norm, with gradients
    x = torch.randn(4, 7, 64, generator=g, requires_grad=True)
    rms_norm(x, torch.ones(64), 1e-5).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_rope_roll_equals_rotate_half_bit_for_bit_and_in_gradient():
    cfg = ModelConfig(vocab_size=97, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2)
    rot = Rotary(cfg)
    pos = torch.tensor([[0, 1, 2, 3], [100, 7, 31, 2047 % cfg.max_position_embeddings]])
    cos, sin = rot(pos, 2048)  # [B, T, 1, hd]; sin carries rotate-half's sign
    half = cfg.head_dim // 2
    plain_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # transformers' table
    assert torch.equal(plain_sin[..., :half], plain_sin[..., half:])  # [s, s], as HF builds it
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 6, cfg.head_dim, generator=g, requires_grad=True)
    ours = apply_rotary(x, cos, sin)
    ref = _rotate_half_reference(x, cos, plain_sin)
    assert torch.equal(ours, ref)
    (gx,) = torch.autograd.grad(ours.square().sum(), x)
    (gr,) = torch.autograd.grad(ref.square().sum(), x)
    assert torch.equal(gx, gr)
    xb = x.detach().bfloat16()  # bf16: rotated in fp32, rounded once
    want = _rotate_half_reference(xb.float(), cos, plain_sin).bfloat16()
    assert torch.equal(apply_rotary(xb, cos, sin), want)


def test_cache_write_puts_each_rows_tokens_at_its_own_positions():
    cfg = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    cache = KVCache(cfg, num_slots=5, max_len=16)
    pos = torch.tensor([[3, 4, 5], [0, 1, 2], [9, 10, 11]])  # [B=3, T=3], rows at their own offsets
    g = torch.Generator().manual_seed(2)
    k = torch.randn(3, 3, cfg.num_kv_heads, cfg.head_dim, generator=g)
    v = torch.randn(3, 3, cfg.num_kv_heads, cfg.head_dim, generator=g)
    keys, values = cache.layer(1, 2, cache.write_index(pos)).write(k, v, 12)  # slots 2..4
    assert keys.shape == (3, cfg.num_kv_heads, 12, cfg.head_dim)
    for b in range(3):
        for t in range(3):
            assert torch.equal(cache.k[1, 2 + b, :, pos[b, t]], k[b, t])
            assert torch.equal(cache.v[1, 2 + b, :, pos[b, t]], v[b, t])
    written = torch.zeros_like(cache.k, dtype=torch.bool)
    for b in range(3):
        written[1, 2 + b, :, pos[b]] = True
    assert (cache.k[~written] == 0).all() and (cache.v[~written] == 0).all()  # nothing else
    assert torch.equal(keys, cache.k[1, 2:5, :, :12])


def _decode_run(model, scripted):
    """Prefill 3 rows at their own lengths, then decode and verify steps; every output."""
    from specroll.model import decode

    decode.set_scripted(scripted)
    try:
        g = torch.Generator().manual_seed(3)
        cache = KVCache(model.cfg, num_slots=4, max_len=40)
        outs = []
        with torch.no_grad():
            prompt = torch.randint(0, 97, (3, 9), generator=g)
            o = model(prompt, positions=torch.zeros(3, dtype=torch.long), cache=cache)
            outs.append(o.logits)
            pos = torch.tensor([9, 7, 8])
            for T in (1, 1, 3, 1, 4):  # decode steps and verification forwards
                tokens = torch.randint(0, 97, (3, T), generator=g)
                o = model(tokens, positions=pos, cache=cache, hidden_layers=(0, 1, 2))
                outs += [o.logits, *(o.hidden[i] for i in (0, 1, 2))]
                pos = pos + T
        return outs, cache
    finally:
        decode.set_scripted(True)


def test_scripted_decode_layers_equal_the_eager_loop_bit_for_bit():
    from specroll.model.packed import GEMMS, set_cpu_gemm
    from specroll.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    model = Transformer(cfg).init_weights(seed=4).eval()
    try:
        for gemm in GEMMS:  # both packed kernels the scripted loop calls
            set_cpu_gemm(gemm)
            eager, eager_cache = _decode_run(model, scripted=False)
            for _ in range(3):  # past TorchScript's profiling runs, too
                ours, cache = _decode_run(model, scripted=True)
                assert all(torch.equal(a, b) for a, b in zip(ours, eager, strict=True)), gemm
                assert torch.equal(cache.k, eager_cache.k) and torch.equal(cache.v, eager_cache.v)
    finally:
        set_cpu_gemm(None)


def test_scripted_layers_serve_only_what_they_implement():
    from specroll.model import decode
    from specroll.model.transformer import Transformer

    base = dict(vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
    llama = Transformer(ModelConfig(**base)).init_weights().eval()
    x = torch.zeros(1, 1, 64)
    with torch.no_grad():
        packed = llama.packed_weights()
        assert decode.applies(llama, x, packed)
        assert not decode.applies(llama, x.bfloat16(), packed)  # bf16 norms differ: eager
        for extra in (dict(qk_norm=True), dict(attention_bias=True)):  # Qwen3 / Qwen2 layers
            other = Transformer(ModelConfig(**base, **extra)).init_weights().eval()
            assert not decode.applies(other, x, other.packed_weights())
    assert not decode.applies(llama, x, packed)  # autograd on: the learner's eager path
