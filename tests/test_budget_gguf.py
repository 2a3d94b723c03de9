"""The bounds and the memory estimate see a GGUF policy as the loader will load it.

A `.gguf` policy is converted to an HF directory before it is loaded (`model.gguf`), and
its config.json is what the engine and the learner are built from. The checks that run
before any load (`rl.limits`, `rl.memory_estimate`) read the same file's metadata through
the same reader (`model.gguf.gguf_config`), so they size exactly the model the loader
builds, including files that leave out metadata the loader does not need: the feed-forward
width comes from the tensors, and the head width from the RoPE dimension when the file has
no key length.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from specroll.model.gguf import gguf_to_hf
from specroll.model.weights import read_config
from specroll.rl import limits, memory_estimate
from specroll.rl.config import build_config
from tests.test_gguf import _tiny_model, _write_gguf


def _both(path: Path, tmp_path: Path):
    """(what the bounds read, what the loader loads) for one GGUF file."""
    checked = limits.read_model_config(str(path))
    loaded = read_config(gguf_to_hf(path, tmp_path / "hf", tokenizer=False))
    return checked, loaded


@pytest.mark.parametrize(
    ("model_type", "quantize"),
    [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", False)],
)
def test_bounds_and_loader_agree_on_a_gguf(tmp_path: Path, model_type: str, quantize: bool):
    path = tmp_path / "tiny.gguf"
    with torch.no_grad():
        _write_gguf(_tiny_model(model_type), path, quantize=quantize)
    checked, loaded = _both(path, tmp_path)
    assert checked == loaded
    cfg = build_config("tiny")
    prompt = limits.prompt_tokens(cfg)
    assert memory_estimate.estimate(cfg, checked, prompt) == memory_estimate.estimate(
        cfg, loaded, prompt
    )


def test_metadata_the_loader_does_not_need_is_not_guessed(tmp_path: Path, monkeypatch):
    """No `feed_forward_length` (the loader reads the width off the gate tensor, 96, where
    a guess of 4 x hidden would be 256) and no `attention.key_length` but a RoPE
    dimension (the loader's head width, 32, not hidden / heads = 16)."""
    monkeypatch.setattr(gguf.GGUFWriter, "add_feed_forward_length", lambda self, n: None)
    monkeypatch.setattr(gguf.GGUFWriter, "add_key_length", gguf.GGUFWriter.add_rope_dimension_count)
    path = tmp_path / "tiny.gguf"
    with torch.no_grad():
        _write_gguf(_tiny_model("qwen3"), path)
    checked, loaded = _both(path, tmp_path)
    assert (loaded.intermediate_size, loaded.head_dim) == (96, 32)
    assert checked == loaded


def test_an_unsupported_architecture_is_refused_before_loading(tmp_path: Path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'falcon'"):
        limits.read_model_config(str(path))
