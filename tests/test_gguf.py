"""Tests for specroll.model.gguf: GGUF -> HF directory conversion.

The tiny GGUF files are written here from randomly initialised transformers models the way
llama.cpp's converter writes them (gguf's own HF->GGUF name map, q/k permuted for llama), so
the round trip checks the conversion against an independent reference without any download.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from specroll.model.gguf import gguf_to_hf

VOCAB = 128
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
ARCHS = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}


def _tiny_model(model_type: str) -> torch.nn.Module:
    """A tiny model with every parameter random (norms too, so a swapped norm is caught)."""
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        tie_word_embeddings=model_type != "llama",
    )
    if model_type == "qwen3":
        kw["head_dim"] = 32  # != hidden / heads, so it must come from attention.key_length
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (rotate_half -> interleaved pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_tokenizer(w: gguf.GGUFWriter) -> None:
    """A minimal byte-level BPE ("gpt2") vocabulary of VOCAB tokens with a few merges."""
    merges = ["Ġ t", "h e", "Ġt he", "l l", "e ll", "h ell", "hell o"]
    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(33, 127)] + ["Ġ"]
    tokens += [m.replace(" ", "") for m in merges]
    tokens += [f"<extra_{i}>" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)


def _write_gguf(model: torch.nn.Module, path: Path, quantize: bool = False) -> None:
    """Write `model` as a GGUF file; with `quantize`, matrices are stored as Q8_0 and the model's
    weights are replaced by their dequantised values so it stays the exact reference."""
    cfg = model.config
    arch = cfg.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if arch == "qwen3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    _write_tokenizer(w)
    names = gguf.get_tensor_name_map(ARCHS[arch], cfg.num_hidden_layers)
    for hf_name, p in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = p.numpy().astype(np.float32)
        if quantize and data.ndim == 2:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            data_deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
            p.copy_(torch.from_numpy(data_deq))
            data = p.numpy().astype(np.float32)
        if arch == "llama" and ".attn_q." in name:
            data = _llama_cpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            data = _llama_cpp_permute(data, cfg.num_key_value_heads)
        if quantize and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    ("model_type", "quantize"),
    [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", False)],
)
def test_roundtrip_logits_match(tmp_path: Path, model_type: str, quantize: bool) -> None:
    model = _tiny_model(model_type)
    with torch.no_grad():
        _write_gguf(model, tmp_path / "tiny.gguf", quantize=quantize)
    calls: list[tuple[int, int]] = []
    out = gguf_to_hf(
        tmp_path / "tiny.gguf", tmp_path / "hf", progress=lambda d, t: calls.append((d, t))
    )

    assert out == tmp_path / "hf"
    n_tensors = len(model.state_dict()) - int(model.config.tie_word_embeddings)
    assert calls == [(i, n_tensors) for i in range(1, n_tensors + 1)]
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert loaded.config.model_type == model_type
    assert loaded.config.tie_word_embeddings == model.config.tie_word_embeddings
    cfg = model.config
    assert loaded.config.head_dim == (getattr(cfg, "head_dim", None) or 64 // 4)
    assert loaded.config.rope_parameters["rope_theta"] == 50000.0
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)

    tok = AutoTokenizer.from_pretrained(out)
    text = "hello the world"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert chat == "<s>user: hi</s>"
    assert (loaded.config.bos_token_id, loaded.config.eos_token_id) == (1, 2)


def test_without_tokenizer_and_replaces_existing_dir(tmp_path: Path) -> None:
    model = _tiny_model("qwen2")
    with torch.no_grad():
        _write_gguf(model, tmp_path / "tiny.gguf")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "stale.txt").write_text("old")
    gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", tokenizer=False)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.gguf"]  # no temp dirs left


def test_interrupted_conversion_leaves_nothing(tmp_path: Path) -> None:
    with torch.no_grad():
        _write_gguf(_tiny_model("llama"), tmp_path / "tiny.gguf")

    def boom(done: int, total: int) -> None:
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gguf_to_hf(tmp_path / "tiny.gguf", tmp_path / "hf", progress=boom)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        gguf_to_hf(tmp_path / "nope.gguf", tmp_path / "hf")


def test_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip file")
    with pytest.raises(ValueError, match=r"model\.gguf.*not a GGUF file"):
        gguf_to_hf(bad, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'falcon'.*supported: llama, qwen2, qwen3"):
        gguf_to_hf(path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def _smollm2_gguf() -> Path:
    """The SmolLM2 GGUF: $SPECROLL_SMOLLM2_GGUF, else fetched into the specroll cache."""
    if "SPECROLL_SMOLLM2_GGUF" in os.environ:
        return Path(os.environ["SPECROLL_SMOLLM2_GGUF"])
    from specroll.model.hub import _download_gguf, home

    return _download_gguf(home() / "downloads", None)


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loader(tmp_path: Path) -> None:
    SMOLLM2 = _smollm2_gguf()
    out = gguf_to_hf(SMOLLM2, tmp_path / "hf")
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(
        SMOLLM2.parent, gguf_file=SMOLLM2.name, dtype=torch.float32
    ).eval()
    tok = AutoTokenizer.from_pretrained(out)
    msgs = [{"role": "user", "content": "What is 7 times 8?"}]
    ids = tok.apply_chat_template(
        msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        torch.testing.assert_close(ours(**ids).logits, ref(**ids).logits, atol=1e-5, rtol=0)
