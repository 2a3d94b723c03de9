"""Shared fixtures: tiny randomly initialised models of each architecture (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# (name, transformers config class name, extra config fields)
VARIANTS = {
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama-untied-mha": ("LlamaConfig", dict(tie_word_embeddings=False, num_key_value_heads=4)),
    "llama3-rope": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "qwen2-bias": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3-qknorm": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "qwen3-untied": ("Qwen3Config", dict(tie_word_embeddings=False, num_key_value_heads=1)),
}


def make_hf_model(variant: str, seed: int = 0):
    """A tiny transformers model with non-trivial weights (biases and norms randomised)."""
    import transformers

    cls_name, extra = VARIANTS[variant]
    cfg = getattr(transformers, cls_name)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, tuple[object, str]]:
    """variant → (transformers model, saved directory)."""
    out = {}
    for v in VARIANTS:
        model = make_hf_model(v)
        d = tmp_path_factory.mktemp(v)
        model.save_pretrained(d)
        out[v] = (model, str(d))
    return out


@pytest.fixture(scope="session")
def tiny_model(hf_dirs):
    """A specroll Transformer loaded from the tiny Llama directory."""
    from specroll.model import load_model

    return load_model(hf_dirs["llama-tied"][1])


def assert_greedy_matches_hf(ours, hf, prompts: list[list[int]], n: int = 64) -> None:
    """specroll's engine and transformers' `generate` agree on n greedy tokens per prompt."""
    from specroll.engine import Engine, Request, SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=())
    results = Engine(ours).generate([Request(p, params) for p in prompts])
    for p, r in zip(prompts, results, strict=True):
        out = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        assert r.token_ids == out[0, len(p) :].tolist()


@pytest.fixture()
def tiny_setup(tmp_path, monkeypatch):
    """(policy, tokenizer) of the tiny preset, built into a fresh SPECROLL_HOME."""
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path / "home"))
    from specroll.model import load_model
    from specroll.model.hub import resolve
    from specroll.model.tokenizer import Tokenizer

    d = resolve("tiny")
    return load_model(d), Tokenizer(d)
