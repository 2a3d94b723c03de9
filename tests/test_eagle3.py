"""EAGLE-3 head: cache/full-sequence equivalence, recursion, vLLM checkpoint layout, vocab map."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specroll.drafters.eagle3 import Eagle3Drafter
from specroll.drafting.eagle3_head import Eagle3Config, Eagle3Head
from specroll.drafting.eagle3_io import load_eagle3, save_eagle3
from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine.depth import FixedDepth
from specroll.model import ModelConfig, Transformer
from tests.conftest import VOCAB, spec_drafters, spec_model

TARGET = ModelConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=128,
)
DRAFT_VOCAB = 50


def vllm_layout(H=64, q=64, kv=32, inter=96, vd=DRAFT_VOCAB, v=97) -> dict[str, tuple]:
    """Tensor names and [out, in] shapes read by vLLM's llama_eagle3.py (SpecForge export)."""
    return {
        "fc.weight": (H, 3 * H),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, q),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (inter, H),
        "midlayer.mlp.up_proj.weight": (inter, H),
        "midlayer.mlp.down_proj.weight": (H, inter),
        "norm.weight": (H,),
        "lm_head.weight": (vd, H),
        "d2t": (vd,),
        "t2d": (v,),
    }


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer(TARGET).init_weights(seed=0, std=0.1).eval()


def make_head(target: Transformer, seed: int = 1) -> Eagle3Head:
    head = Eagle3Head(Eagle3Config.for_target(TARGET, DRAFT_VOCAB), target)
    head.init_weights(seed, std=0.15)
    with torch.no_grad():  # non-trivial norms and a non-identity vocabulary map
        for p in (head.hidden_norm, head.input_layernorm, head.post_attention_layernorm):
            p.normal_(1.0, 0.1, generator=torch.Generator().manual_seed(seed))
        used = torch.randperm(97, generator=torch.Generator().manual_seed(seed))[:DRAFT_VOCAB]
        used = used.sort().values
        head.d2t.copy_(used - torch.arange(DRAFT_VOCAB))
        head.t2d.zero_()[used] = True
    return head.eval()


def features(target: Transformer, head: Eagle3Head, x: torch.Tensor) -> torch.Tensor:
    out = target(x, hidden_layers=head.cfg.aux_layers, return_logits=False)
    return head.fuse([out.hidden[i] for i in head.cfg.aux_layers])  # [B, T, H]


def test_default_aux_layers_match_vllm_and_specforge(target):
    # vLLM: inputs of layers (2, L//2, L-3); e.g. Llama-3.1-8B (32 layers) -> (2, 16, 29)
    for L, want in ((32, (2, 16, 29)), (28, (2, 14, 25)), (4, (2, 2, 1))):
        cfg = ModelConfig(num_layers=L, hidden_size=64, num_heads=4, num_kv_heads=2)
        assert Eagle3Config.for_target(cfg).aux_layers == want
    # SpecForge hooks the *outputs* of layers [1, L//2-1, L-4]: the same residual states
    L = TARGET.num_layers
    caught: dict[int, torch.Tensor] = {}
    hooks = [
        target.layers[j].register_forward_hook(lambda m, a, o, j=j: caught.__setitem__(j, o))
        for j in {1, L // 2 - 1, L - 4}
    ]
    x = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target(x, hidden_layers=(2, L // 2, L - 3))
    for h in hooks:
        h.remove()
    aux = Eagle3Config.for_target(TARGET).aux_layers
    for j, i in zip((1, L // 2 - 1, L - 4), aux, strict=True):
        assert torch.equal(caught[j], out.hidden[i])


def test_incremental_decode_equals_full_sequence(target):
    head = make_head(target)
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 97, (3, 24), generator=g)
    with torch.no_grad():
        feat = features(target, head, x)
        full, full_pre = head(x, feat)  # [3, 24, Vd], [3, 24, H]
        cache = head.new_cache(num_slots=4, max_len=32)
        lengths = torch.tensor([5, 8, 3])  # prefill, then rows advance by 1 / 3 / 2
        w = int(lengths.max())
        first, _ = head(x[:, :w], feat[:, :w], torch.zeros(3, dtype=torch.long), cache, 1)
        for b in range(3):
            n = int(lengths[b])
            assert (first[b, :n] - full[b, :n]).abs().max() <= 1e-5
        pos, steps = lengths.clone(), torch.tensor([1, 3, 2])
        while int((pos + steps).max()) <= 24:
            idx = (pos.unsqueeze(1) + torch.arange(int(steps.max()))).clamp(max=23)
            tok, h = x.gather(1, idx), feat.gather(1, idx.unsqueeze(-1).expand(-1, -1, 64))
            logits, pre = head(tok, h, pos, cache, slot_start=1)
            for b in range(3):
                n, p = int(steps[b]), int(pos[b])
                assert (logits[b, :n] - full[b, p : p + n]).abs().max() <= 1e-5
                assert (pre[b, :n] - full_pre[b, p : p + n]).abs().max() <= 1e-5
            pos = pos + steps


def test_recursive_drafting_feeds_prenorm_hidden_back(target):
    head = make_head(target)
    x = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        feat = features(target, head, x)
        cache = head.new_cache(2, 16)
        logits, pre = head(x, feat, torch.zeros(2, dtype=torch.long), cache)
        toks, hs = [x], [feat]
        pos = torch.full((2,), 6)
        for _ in range(3):  # draft k=3 tokens: argmax, map to target ids, feed prenorm back
            nxt = head.draft_to_target(logits[:, -1].argmax(-1, keepdim=True))  # [2, 1]
            assert bool(head.t2d[nxt].all())
            toks.append(nxt)
            hs.append(pre[:, -1:])
            logits, pre = head(nxt, pre[:, -1:], pos, cache)
            assert logits.shape == (2, 1, DRAFT_VOCAB) and pre.shape == (2, 1, 64)
            pos = pos + 1
        # the same (token, hidden) sequence in one causal pass gives the same last step
        full, _ = head(torch.cat(toks, 1), torch.cat(hs, 1))
        assert (full[:, -1] - logits[:, 0]).abs().max() <= 1e-5


def test_draft_loss_gives_no_gradient_to_the_target_embedding(target):
    head = make_head(target).train()
    x = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(4))
    feat = torch.randn(2, 7, 3 * 64)
    logits, _ = head(x, head.fuse(feat.split(64, dim=-1)))
    logits.logsumexp(-1).sum().backward()
    assert target.embed.grad is None
    assert head.fc.grad is not None and head.wqkv.grad is not None


def test_checkpoint_roundtrip_is_bit_exact_in_vllm_layout(target, tmp_path):
    head = make_head(target)
    save_eagle3(head, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["model_type"] == "llama"
    assert hf["num_hidden_layers"] == 1 and hf["draft_vocab_size"] == DRAFT_VOCAB
    assert hf["vocab_size"] == 97 and hf["hidden_size"] == 64
    assert hf["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert {n: tuple(t.shape) for n, t in tensors.items()} == vllm_layout()
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool

    x = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(5))
    h = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = head(x, h)
    for variant in ("midlayer", "layers.0", "with_embed"):
        d = tmp_path / variant
        d.mkdir()
        (d / "config.json").write_text((tmp_path / "config.json").read_text())
        renamed = {n.replace("midlayer.", f"{variant}."): t for n, t in tensors.items()}
        if variant == "with_embed":  # SpecForge may keep embed_tokens; the target's is used
            renamed = {**tensors, "embed_tokens.weight": torch.zeros(97, 64)}
        save_file(renamed, str(d / "model.safetensors"))
        loaded = load_eagle3(d, TARGET, target.embed_tokens).eval()
        assert loaded.cfg == head.cfg
        for (n, a), (_, b) in zip(
            head.state_dict().items(), loaded.state_dict().items(), strict=True
        ):
            assert a.dtype == b.dtype and torch.equal(a, b), n
        with torch.no_grad():
            out = loaded(x, h)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_to_target_logits_puts_mass_only_on_mapped_ids(target):
    head = make_head(target)
    draft = torch.randn(2, 3, DRAFT_VOCAB)
    full = head.to_target_logits(draft)  # [2, 3, 97]
    used = torch.arange(DRAFT_VOCAB) + head.d2t
    assert full.shape == (2, 3, 97)
    assert torch.equal(torch.isfinite(full[0, 0]), head.t2d)
    assert torch.equal(full[..., used], draft)
    probs = full.softmax(-1)
    assert probs[..., ~head.t2d].sum() == 0
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3))
    assert torch.equal(full.argmax(-1), head.draft_to_target(draft.argmax(-1)))


def test_mismatched_target_or_broken_checkpoint_raises(target, tmp_path):
    save_eagle3(make_head(target), tmp_path)
    with pytest.raises(ValueError, match="hidden_size"):
        load_eagle3(tmp_path, ModelConfig(vocab_size=97, hidden_size=32, num_layers=4))
    with pytest.raises(ValueError, match="vocab_size"):
        load_eagle3(tmp_path, ModelConfig(vocab_size=120, hidden_size=64, num_layers=4))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["midlayer.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="midlayer.mlp.up_proj.weight"):
        load_eagle3(tmp_path, TARGET)
    with pytest.raises(ValueError, match="aux_layers"):
        dataclasses.replace(Eagle3Config.for_target(TARGET), aux_layers=(1, 2))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.for_target(TARGET, draft_vocab_size=200)


def reference_forward(t: dict[str, torch.Tensor], emb, h, eps=1e-6, theta=10000.0, nh=4, nkv=2):
    """Independent EAGLE-3 layer on the saved [out, in] tensors (vLLM / SpecForge semantics)."""
    F = torch.nn.functional

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x):  # [B, heads, T, hd], HF rotate-half
        d = x.shape[-1]
        inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
        ang = torch.arange(x.shape[2]).float()[:, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

    B, T, H = h.shape
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    x = torch.cat(
        [rms(emb, t["midlayer.input_layernorm.weight"]), rms(h, t["midlayer.hidden_norm.weight"])],
        -1,
    )
    q = rope(F.linear(x, t[a + "q_proj.weight"]).view(B, T, nh, -1).transpose(1, 2))
    k = rope(F.linear(x, t[a + "k_proj.weight"]).view(B, T, nkv, -1).transpose(1, 2))
    v = F.linear(x, t[a + "v_proj.weight"]).view(B, T, nkv, -1).transpose(1, 2)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -torch.inf)
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
    x = h + F.linear(o, t[a + "o_proj.weight"])
    y = rms(x, t["midlayer.post_attention_layernorm.weight"])
    y = F.silu(F.linear(y, t[m + "gate_proj.weight"])) * F.linear(y, t[m + "up_proj.weight"])
    pre = x + F.linear(y, t[m + "down_proj.weight"])
    return F.linear(rms(pre, t["norm.weight"]), t["lm_head.weight"]), pre


def test_saved_tensors_mean_what_vllm_expects(target, tmp_path):
    head = make_head(target)
    save_eagle3(head, tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    x = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(7))
    aux = torch.randn(2, 7, 3 * 64, generator=torch.Generator().manual_seed(8))
    h = torch.nn.functional.linear(aux, t["fc.weight"])  # combine_hidden_states: fc([B,T,3H])
    with torch.no_grad():
        assert (head.fuse(aux.split(64, dim=-1)) - h).abs().max() <= 1e-5
        logits, pre = head(x, h)
        ref_logits, ref_pre = reference_forward(t, target.embed_tokens(x), h)
    assert (logits - ref_logits).abs().max() <= 1e-5
    assert (pre - ref_pre).abs().max() <= 1e-5


def test_fusion_runs_only_for_the_pairs_fed(monkeypatch):
    """EAGLE-3 keeps the target's three states per committed pair and fuses them when
    the pairs are fed: a drafter that never drafts runs no matmul, and one that does
    proposes what fusing every pair at commit proposes (seeded sampling at T = 1)."""
    target = spec_model(0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 14, 6, 5)]
    params = [SamplingParams(1.0, max_new_tokens=40, seed=i, stop_token_ids=()) for i in range(5)]
    reqs = [Request(q, p) for q, p in zip(prompts, params, strict=True)]
    fused = []
    fuse = Eagle3Head.fuse
    monkeypatch.setattr(Eagle3Head, "fuse", lambda self, aux: fused.append(1) or fuse(self, aux))
    idle = spec_drafters(target)["eagle3"]()
    Engine(target, EngineConfig(max_batch=3), idle, FixedDepth(0)).generate(reqs)
    assert idle.lazy and not fused  # kept, never fused
    runs = []
    for lazy_bytes in (Eagle3Drafter.lazy_bytes, 0):  # lazy, then fused at commit
        drafter = spec_drafters(target)["eagle3"]()
        drafter.lazy_bytes = lazy_bytes
        eng = Engine(target, EngineConfig(max_batch=3), drafter, FixedDepth(3))
        out = eng.generate(reqs)
        assert drafter.lazy is (lazy_bytes > 0) and eng.stats.draft_tokens > 0
        runs.append(([r.token_ids for r in out], eng.stats.draft_tokens, eng.stats.accepted_tokens))
    assert runs[0] == runs[1]
