"""MTP draft heads: incremental = full sequence, head cycling, save/load, native naming."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specroll.drafting.mtp_heads import MTPConfig, MTPDraft
from specroll.drafting.mtp_io import load_mtp, load_native_mtp, save_mtp
from specroll.model.config import ModelConfig
from specroll.model.kv_cache import KVCache
from specroll.model.transformer import Transformer

CFG = ModelConfig(
    model_type="qwen3",
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    max_position_embeddings=128,
    qk_norm=True,
    attention_bias=True,  # covers every optional tensor (bqkv, q_norm, k_norm)
)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer(CFG).init_weights(0)


def _draft(target, n=1, seed=1, last=False, **kw) -> MTPDraft:
    draft = MTPDraft(MTPConfig.for_target(CFG, n, **kw), target)
    draft.init_weights(seed, from_last_layer=last)
    with torch.no_grad():  # non-trivial norms, so a norm read from the wrong tensor shows
        for k, (name, p) in enumerate(draft.named_parameters()):
            if "norm" in name.rsplit(".", 1)[-1]:
                p.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(k))
    return draft


def _inputs(B=3, T=12, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (B, T), generator=g), torch.randn(B, T, 64, generator=g)


def _close(a, b):
    assert (a - b).abs().max() <= 1e-5


def test_incremental_equals_full_sequence(target):
    draft = _draft(target, n=2, last=True)
    x, h = _inputs()
    # training path (autograd on, unpacked LM head) for both heads
    full = [tuple(t.detach() for t in draft(i, x, h)) for i in (0, 1)]
    with torch.no_grad():
        cache = draft.new_cache(num_slots=4, max_len=20)  # both heads share it (a layer each)
        # rows enter at different times through slot_start, prefilled to 3 / 5 / 2 tokens
        lengths = [3, 5, 2]
        for b, n in enumerate(lengths):
            for i, (ref, ref_st) in enumerate(full):
                logits, st = draft(i, x[b : b + 1, :n], h[b : b + 1, :n], cache=cache, slot_start=b)
                _close(logits[0], ref[b, :n])
                _close(st[0], ref_st[b, :n])
        pos, steps = torch.tensor(lengths), torch.tensor([1, 3, 2])
        while int((pos + steps).max()) <= 12:
            w = int(steps.max())  # padded tails are written but overwritten next step
            idx = (pos.unsqueeze(1) + torch.arange(w)).clamp(max=11)
            hid = h.gather(1, idx.unsqueeze(-1).expand(-1, -1, 64))
            for i, (ref, ref_st) in enumerate(full):
                logits, st = draft(i, x.gather(1, idx), hid, positions=pos, cache=cache)
                for b in range(3):
                    s = slice(int(pos[b]), int(pos[b] + steps[b]))
                    _close(logits[b, : steps[b]], ref[b, s])
                    _close(st[b, : steps[b]], ref_st[b, s])
            pos = pos + steps
        last = torch.tensor([[4], [7], [0]])
        sel, _ = draft(1, x, h, logits_index=last)
        _close(sel[:, 0], full[1][0][torch.arange(3), last[:, 0]])


def test_recursive_use_cycles_heads(target):
    draft = _draft(target, n=2)
    x, h = _inputs(B=2, T=5)
    with torch.no_grad():
        outs = [draft(i, x, h)[0] for i in range(3)]
        assert torch.equal(outs[2], outs[0]) and not torch.allclose(outs[1], outs[0])
        # k = 3 recursive drafting: depth d runs head d % 2 on the state depth d-1 returned
        cache = draft.new_cache(2, 16)
        pos = torch.tensor([5, 5])
        _, state = draft(0, x, h, cache=cache)  # prefill head 0 (depth 0)
        state, tok = state[:, -1:], x[:, -1:]
        for d in range(3):
            logits, state = draft(d, tok, state, positions=pos + d, cache=cache)
            assert logits.shape == (2, 1, 97) and state.shape == (2, 1, 64)
            tok = logits.argmax(-1)
    with pytest.raises(ValueError, match="cache has 4 layers"):
        draft(0, x, h, cache=KVCache(CFG, 2, 16))  # the target's cache, not the draft's


def test_embedding_first_and_init_from_last_layer(target):
    draft = _draft(target, last=True)
    assert torch.equal(draft.heads[0].block.w_gate_up, target.layers[-1].w_gate_up)
    x, h = _inputs(B=1, T=4)
    with torch.no_grad():
        draft.heads[0].eh_proj[64:] = 0  # the rows that act on hnorm(h): h no longer matters
        a, b, c = draft(0, x, h)[0], draft(0, x, 2 * h + 1)[0], draft(0, (x + 1) % 97, h)[0]
    assert torch.allclose(a, b, atol=1e-7) and not torch.allclose(a, c)


def test_no_gradient_reaches_the_target(target):
    draft = _draft(target)
    x, h = _inputs(B=2, T=4)
    draft(0, x, h)[0].square().sum().backward()
    assert all(p.grad is None for p in target.parameters())
    assert all(p.grad is not None for p in draft.parameters())
    draft.zero_grad(set_to_none=True)
    assert not any("embed" in k for k in draft.state_dict())


def test_save_load_round_trip_bit_exact(target, tmp_path):
    draft = _draft(target, n=2, own_final_norm=True)
    loaded = load_mtp(save_mtp(draft, tmp_path / "mtp"), target)
    assert loaded.cfg == draft.cfg
    for (n1, p1), (n2, p2) in zip(draft.named_parameters(), loaded.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    x, h = _inputs()
    with torch.no_grad():
        assert torch.equal(draft(1, x, h)[0], loaded(1, x, h)[0])
    # a wrong shape in our own format names the tensor
    state = {k: v.clone() for k, v in draft.state_dict().items()}
    state["heads.1.block.wo"] = state["heads.1.block.wo"][:, :32].contiguous()
    save_file(state, tmp_path / "mtp" / "mtp.safetensors")
    with pytest.raises(ValueError, match="heads.1.block.wo"):
        load_mtp(tmp_path / "mtp", target)


def _layer_hf(block, prefix: str, off: float) -> dict[str, torch.Tensor]:
    """A Block's tensors under Llama/Qwen HF names ([out, in], q/k/v and gate/up split)."""
    q, kv, inter = CFG.q_size, CFG.kv_size, CFG.intermediate_size
    wq, wk, wv = block.wqkv.T.split([q, kv, kv])
    bq, bk, bv = block.bqkv.split([q, kv, kv])
    gate, up = block.w_gate_up.T.split([inter, inter])
    a = prefix + "self_attn."
    return {
        prefix + "input_layernorm.weight": block.attn_norm - off,
        prefix + "post_attention_layernorm.weight": block.mlp_norm - off,
        a + "q_proj.weight": wq, a + "k_proj.weight": wk, a + "v_proj.weight": wv,
        a + "q_proj.bias": bq, a + "k_proj.bias": bk, a + "v_proj.bias": bv,
        a + "q_norm.weight": block.q_norm - off, a + "k_norm.weight": block.k_norm - off,
        a + "o_proj.weight": block.wo.T,
        prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
        prefix + "mlp.down_proj.weight": block.w_down.T,
    }  # fmt: skip


def _qwen3_next(draft, off=0.0) -> dict[str, torch.Tensor]:
    hd = draft.heads[0]
    return {
        "mtp.pre_fc_norm_embedding.weight": hd.enorm - off,
        "mtp.pre_fc_norm_hidden.weight": hd.hnorm - off,
        "mtp.fc.weight": hd.eh_proj.T,
        "mtp.norm.weight": hd.final_norm - off,
        **_layer_hf(hd.block, "mtp.layers.0.", off),
    }


def _write(d, tensors, model_type="qwen3"):
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, d / "mtp.safetensors")
    (d / "config.json").write_text(json.dumps({**CFG.to_hf(), "model_type": model_type}))
    return d


def _same_outputs(a: MTPDraft, b: MTPDraft, tol=0.0):
    x, h = _inputs()
    with torch.no_grad():
        for i in range(a.num_heads):
            (la, sa), (lb, sb) = a(i, x, h), b(i, x, h)
            assert (la - lb).abs().max() <= tol and (sa - sb).abs().max() <= tol


def test_native_qwen3_next_naming(target, tmp_path):
    src = _draft(target, own_final_norm=True, feed_back_normed=True)
    loaded = load_native_mtp(_write(tmp_path / "q", _qwen3_next(src)), target)
    assert loaded.cfg == src.cfg
    _same_outputs(src, loaded)
    # Gemma-style (1 + w) norms, detected from model_type
    d = _write(tmp_path / "qn", _qwen3_next(src, off=1.0), model_type="qwen3_next")
    _same_outputs(src, load_native_mtp(d, target), tol=1e-6)


def test_native_deepseek_naming(target, tmp_path):
    src = _draft(target, n=2, own_final_norm=True)
    tensors = {}
    for i, hd in enumerate(src.heads):
        p = f"model.layers.{4 + i}."
        tensors.update(_layer_hf(hd.block, p, 0.0))
        tensors.update({
            p + "enorm.weight": hd.enorm, p + "hnorm.weight": hd.hnorm,
            p + "eh_proj.weight": hd.eh_proj.T, p + "shared_head.norm.weight": hd.final_norm,
            p + "embed_tokens.weight": target.embed.T,
            p + "shared_head.head.weight": target.embed.T,
        })  # fmt: skip
    tensors["model.layers.0.input_layernorm.weight"] = torch.ones(64)  # target's: ignored
    loaded = load_native_mtp(_write(tmp_path / "ds", tensors, "deepseek_v3"), target)
    assert loaded.num_heads == 2 and loaded.cfg == src.cfg
    _same_outputs(src, loaded)
    tensors["model.layers.5.mlp.experts.0.up_proj.weight"] = torch.ones(96, 64)  # MoE: refused
    with pytest.raises(ValueError, match="experts"):
        load_native_mtp(_write(tmp_path / "ds2", tensors, "deepseek_v3"), target)


@pytest.mark.parametrize(
    "name, how",
    [
        ("mtp.layers.0.self_attn.k_proj.weight", "shape"),
        ("mtp.fc.weight", "shape"),
        ("mtp.layers.0.mlp.up_proj.weight", "missing"),
        ("mtp.norm.weight", "missing"),
    ],
)
def test_native_errors_name_the_tensor(target, tmp_path, name, how):
    tensors = _qwen3_next(_draft(target, own_final_norm=True))
    if how == "missing":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:, :-2]
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_native_mtp(_write(tmp_path / "bad", tensors), target)


def test_native_errors_unexpected_and_absent(target, tmp_path):
    tensors = _qwen3_next(_draft(target, own_final_norm=True))
    tensors["mtp.embed_tokens.weight"] = target.embed.T
    with pytest.raises(ValueError, match="mtp.embed_tokens"):
        load_native_mtp(_write(tmp_path / "x", tensors), target)
    with pytest.raises(ValueError, match="no native MTP"):
        load_native_mtp(_write(tmp_path / "y", {"model.norm.weight": torch.ones(64)}), target)
    with pytest.raises(ValueError, match="num_heads_mtp"):
        MTPConfig(num_heads_mtp=0, layer=CFG)
