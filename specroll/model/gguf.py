"""Convert a GGUF checkpoint of a Llama-family model into a Hugging Face model directory.

specroll trains and serves from HF directories (config.json + safetensors), but small models
are often only published as llama.cpp GGUF files. Converting once, up front, lets every other
part of specroll (and plain transformers) load the result without knowing about GGUF.

The output is fp32: quantised blocks are dequantised exactly, so logits match what
transformers computes when it loads the GGUF itself. The file is only ever parsed as data
(no pickle, no remote code).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import gguf
import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from specroll.inputs import regular

# gguf architecture name -> (HF model_type, HF architecture class)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its HF name; unknown tensors are an error, never dropped,
    because silently losing a weight would give a model that loads but computes garbage."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError(
            "GGUF has a rope_freqs tensor (llama3-style RoPE scaling), which cannot be "
            "expressed exactly as a transformers rope config; not supported"
        )
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known Hugging Face equivalent")


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for the llama architecture.

    convert_hf_to_gguf.py reorders each head's rows from HF's "rotate_half" layout (first half,
    second half) to GGML's interleaved pairs, so GGML can rotate adjacent elements. Per head,
    rows are stored as (half_dim, 2); HF wants (2, half_dim).
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """All scalar/string/array key-value fields, except the big tokenizer arrays."""
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    skip += ("tokenizer.ggml.scores",)
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def _f32(x: float) -> float:
    """GGUF stores floats as float32; use the shortest decimal that round-trips (1e-05, not
    9.999999747378752e-06) so config.json reads like the original HF config."""
    return float(str(np.float32(x)))


def _build_config(
    meta: dict[str, Any], arch: str, tensors: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """An HF config dict for `arch`, built through transformers' own config class so every
    field transformers expects (rope_parameters etc. in v5) is present and valid."""
    from transformers import AutoConfig

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    model_type, hf_arch = SUPPORTED_ARCHITECTURES[arch]
    vocab_size, hidden = tensors["model.embed_tokens.weight"]
    n_heads = int(get("attention.head_count"))
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // n_heads
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _f32(get("rope.freq_base", 1e4))}
    scaling = get("rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=_f32(get("rope.scaling.factor")))
    elif scaling == "yarn":
        rope.update(rope_type="yarn", factor=_f32(get("rope.scaling.factor")))
        rope["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    elif scaling != "none":
        raise ValueError(f"GGUF rope scaling type {scaling!r} is not supported")
    tok = "tokenizer.ggml."
    # Chat models often end a turn with an end-of-turn token that differs from eos (llama3's
    # <|eot_id|>); generation must stop on either, so list all of them.
    eos: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        if meta.get(tok + key) is not None and int(meta[tok + key]) not in eos:
            eos.append(int(meta[tok + key]))
    kwargs: dict[str, Any] = {
        "architectures": [hf_arch],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": tensors["model.layers.0.mlp.gate_proj.weight"][0],
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": rope,
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": meta.get(tok + "bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": meta.get(tok + "padding_token_id"),
        "dtype": "float32",
    }
    if arch != "qwen2":  # qwen2 always has q/k/v biases; llama and qwen3 make them optional
        kwargs["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in tensors
    config = AutoConfig.for_model(model_type, **kwargs).to_dict()
    config.pop("_name_or_path", None)
    config["torch_dtype"] = "float32"  # transformers 4.x spelling, for older readers
    return config


def read_gguf(gguf_path: Path) -> tuple[GGUFReader, dict[str, Any], str]:
    """Open `gguf_path` (memory-mapped: no tensor data is read) and check it is a GGUF of a
    supported architecture with the metadata every reader here needs.

    Returns (reader, metadata without the big tokenizer arrays, architecture). This is the
    one place GGUF metadata is read: the converter and the bounds checked before a model
    is loaded (`rl.limits`) both start here, so they agree on what a file holds. Raises
    ValueError for a missing file, a non-GGUF file or an unsupported architecture."""
    if not gguf_path.exists():
        raise ValueError(f"GGUF file {str(gguf_path)!r} does not exist")
    regular(gguf_path, "GGUF file")
    with gguf_path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{str(gguf_path)!r} is not a GGUF file (bad magic)")
    try:  # a truncated or forged file fails anywhere in gguf's parser (IndexError, ...)
        reader = GGUFReader(gguf_path)
        meta = _metadata(reader)
    except Exception as e:
        raise ValueError(
            f"{str(gguf_path)!r} is not a readable GGUF file (truncated or corrupt: "
            f"{type(e).__name__}: {e})"
        ) from e
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{str(gguf_path)!r} has architecture {arch!r}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    for key in (f"{arch}.attention.head_count", f"{arch}.block_count"):
        if key not in meta:
            raise ValueError(f"{str(gguf_path)!r} lacks required metadata {key!r}")
    return reader, meta, arch


def tensor_shapes(reader: GGUFReader) -> dict[str, tuple[int, ...]]:
    """Every tensor's HF name and shape, from the file's tensor index alone (GGUF lists
    dimensions innermost first: the reverse of the dequantised array's shape)."""
    return {_hf_name(t.name): tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}


def gguf_config(gguf_path: str | Path) -> dict[str, Any]:
    """The HF config dict `gguf_to_hf` writes as config.json, read without converting or
    dequantising any tensor: what a memory estimate needs before the model is loaded."""
    gguf_path = Path(gguf_path)
    reader, meta, arch = read_gguf(gguf_path)
    shapes = tensor_shapes(reader)
    for name, gguf_name in (
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.layers.0.mlp.gate_proj.weight", "blk.0.ffn_gate.weight"),
    ):
        if name not in shapes:
            raise ValueError(f"{str(gguf_path)!r} lacks the tensor {gguf_name!r}")
    return _build_config(meta, arch, shapes)


def gguf_to_hf(
    gguf_path: str | Path,
    out_dir: str | Path,
    progress: Callable[[int, int], None] | None = None,
    tokenizer: bool = True,
) -> Path:
    """Convert `gguf_path` (llama / qwen2 / qwen3) into an HF model directory at `out_dir`.

    Writes config.json, generation_config.json, model.safetensors (fp32, standard HF names;
    lm_head.weight only when the GGUF has its own output.weight) and, if `tokenizer`, the
    tokenizer files from transformers' own GGUF tokenizer conversion (chat template included).
    Everything is written into a temporary sibling directory that is renamed into place at the
    end, so an interrupted conversion never leaves a half-written `out_dir`; an existing
    `out_dir` is replaced. `progress(done, total)` is called after each tensor.

    Raises ValueError for a missing file, a non-GGUF file or an unsupported architecture.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader, meta, arch = read_gguf(gguf_path)
    if tokenizer and "tokenizer.ggml.model" not in reader.fields:
        raise ValueError(f"{str(gguf_path)!r} has no tokenizer; pass tokenizer=False")
    n_heads = int(meta[f"{arch}.attention.head_count"])
    n_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        weights = _hf_weights(reader, arch, (n_heads, n_kv_heads), progress)
        shapes = {k: tuple(v.shape) for k, v in weights.items()}
        config = _build_config(meta, arch, shapes)
        _write_configs(tmp, config)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del weights
        if tokenizer:
            _write_tokenizer(gguf_path, tmp, reader)
        # mkdtemp and safetensors create owner-only entries; make the result readable like
        # any other model directory.
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _hf_weights(
    reader: GGUFReader,
    arch: str,
    heads: tuple[int, int],
    progress: Callable[[int, int], None] | None,
) -> dict[str, torch.Tensor]:
    """Every tensor dequantised to fp32 under its HF name, q/k rows back in HF's layout
    (heads: the query and key/value head counts); `progress(done, total)` after each."""
    n_heads, n_kv_heads = heads
    weights: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    for done, t in enumerate(reader.tensors, start=1):
        name = _hf_name(t.name)
        # np.array copies: F32 tensors come back as read-only views of the memory map.
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # Only llama is permuted by llama.cpp; qwen2/qwen3 keep HF's rotate_half layout.
        if arch == "llama" and ".attn_q." in t.name:
            w = _unpermute_rope(w, n_heads)
        elif arch == "llama" and ".attn_k." in t.name:
            w = _unpermute_rope(w, n_kv_heads)
        weights[name] = torch.from_numpy(np.ascontiguousarray(w))
        if progress is not None:
            progress(done, total)
    return weights


def _write_configs(out: Path, config: dict[str, Any]) -> None:
    """config.json and generation_config.json (its special token ids) into `out`."""
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _write_tokenizer(gguf_path: Path, out: Path, reader: GGUFReader | None = None) -> None:
    """The tokenizer files of transformers' own GGUF tokenizer conversion into `out`.

    `reader`: this file's, already parsed; transformers' conversion would parse the whole
    file again (4.6 s of gguf-py's field parsing for SmolLM2 on a 2-core Zen 4, most of a
    first run's conversion), so it is handed that one (the same fields, read-only)."""
    from transformers import AutoTokenizer

    gguf_path = gguf_path.resolve()

    def same_file(path, *args, **kwargs) -> GGUFReader:
        if reader is not None and not (args or kwargs) and Path(path).resolve() == gguf_path:
            return reader
        return GGUFReader(path, *args, **kwargs)

    with mock.patch.object(gguf, "GGUFReader", same_file):  # (imported inside the call)
        tok = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, trust_remote_code=False
        )
    tok.save_pretrained(str(out))


def _replace_dir(src: Path, dst: Path) -> None:
    """Move the finished `src` to `dst`; an old `dst` is moved aside first and deleted only
    once the new one is in place, so some complete directory always exists."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.replace(dst, old / dst.name)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)
