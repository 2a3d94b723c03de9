"""Load and save specroll models as Hugging Face directories (config.json + safetensors).

Weights are data, never code: only safetensors are read (no pickle, no remote code).
HF stores projections `[out, in]` and q/k/v, gate/up separately; specroll fuses them and
stores `[in, out]` (see transformer.py), so loading concatenates and transposes, and saving
splits them back into a directory transformers loads as-is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specroll.inputs import check_finite, read_json, regular, regular_entries
from specroll.model.config import ModelConfig
from specroll.model.lora import parts
from specroll.model.ops import MATRICES
from specroll.model.transformer import Transformer
from specroll.outputs import atomic_path


def load_state(
    module: torch.nn.Module, state: dict[str, torch.Tensor], what: str, partial: bool = False
) -> None:
    """Copy `state` (tensors by name) into `module`'s own tensors in place, with no
    autograd; a name or shape that differs from the module's raises ValueError naming it
    (`what` says whose weights they are). In place, so whatever shares the tensors (a
    drafter on the policy's embedding, a plain engine on the same model) sees them too.
    partial: `state` may name only some of the module's tensors (a LoRA refit: the
    adapters, or the matrices they were merged into); the rest stay."""
    mine = module.state_dict()
    if not (state.keys() <= mine.keys() if partial else state.keys() == mine.keys()):
        raise ValueError(
            f"{what} weights do not match: names differ "
            f"({sorted((set(state) - set(mine)) if partial else set(state) ^ set(mine))[:5]})"
        )
    for name, t in state.items():
        if t.shape != mine[name].shape:
            raise ValueError(
                f"{what} tensor {name} has shape {tuple(t.shape)}, expected "
                f"{tuple(mine[name].shape)}"
            )
    with torch.no_grad():
        for name, t in state.items():
            mine[name].copy_(t)


def hf_names(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """specroll parameter of layer i → the HF tensors it is made of (in order)."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    names = {
        "attn_norm": [p + "input_layernorm.weight"],
        "wqkv": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
        "wo": [a + "o_proj.weight"],
        "mlp_norm": [p + "post_attention_layernorm.weight"],
        "w_gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "w_down": [p + "mlp.down_proj.weight"],
    }
    if cfg.attention_bias:
        names["bqkv"] = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
    if cfg.qk_norm:
        names["q_norm"] = [a + "q_norm.weight"]
        names["k_norm"] = [a + "k_norm.weight"]
    return names


def _is_matrix(name: str) -> bool:
    return name in MATRICES


def read_config(model_dir: str | Path) -> ModelConfig:
    """ModelConfig from `<dir>/config.json`, with a clear error when it is missing; every
    plain entry of the directory must be a regular file (`files.regular_entries`), and
    every size the config implies is bounded (`ModelConfig.from_hf`)."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.is_dir() or not path.exists():
        raise ValueError(f"model path {str(model_dir)!r} has no config.json (not a model dir)")
    regular_entries(model_dir, "model directory")
    return ModelConfig.from_hf(read_json(path, "model config"), str(path))


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model path {str(model_dir)!r} has no *.safetensors weight files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            got = load_file(regular(f, "weight file"))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"weight file {f} is corrupt or unreadable: {e}") from e
        check_finite(got.items(), f)
        tensors.update(got)
    return tensors


def for_inference(
    module: torch.nn.Module,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """`module` (a policy, a draft model, an EAGLE-3 head or MTP heads) moved in place to
    `device` and cast to `dtype` for the rollout engine, in eval mode.

    Floating-point parameters take `dtype` (bf16: a bf16 engine with a bf16 KV cache);
    RoPE tables stay fp32 (`Rotary._apply`), integer buffers (EAGLE-3's vocabulary map)
    keep theirs, and prepacked CPU weights are rebuilt on the next forward. MTP heads and
    EAGLE-3 heads read the policy's embedding and LM head by reference: place the policy
    too. The learner keeps fp32 master weights and never calls this on its own copy.
    """
    return module.to(device=device, dtype=dtype).eval()


def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> Transformer:
    """Load a transformers-format Llama/Qwen2/Qwen3 directory into a specroll Transformer."""
    model_dir = Path(model_dir)
    if not model_dir.exists():
        raise ValueError(f"model path {str(model_dir)!r} does not exist")
    cfg = read_config(model_dir)
    hf = _read_tensors(model_dir)
    held = sum(t.numel() for t in hf.values())
    if cfg.num_params() > held:  # before the model's tensors are allocated
        raise ValueError(
            f"{model_dir / 'config.json'} describes {cfg.num_params():.4g} parameters; the "
            f"weight files hold {held:.4g}: they do not belong together"
        )

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"weights in {model_dir} lack tensor {name!r}")
        return hf.pop(name).to(torch.float32)

    model = Transformer(cfg)  # parameters are torch.empty: no init cost
    state = {"embed": take("model.embed_tokens.weight").T, "norm": take("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        state["lm_head"] = take("lm_head.weight").T
    hf.pop("lm_head.weight", None)  # tied checkpoints sometimes carry a copy
    for i in range(cfg.num_layers):
        for ours, theirs in hf_names(cfg, i).items():
            parts = [take(n) for n in theirs]
            t = torch.cat(parts, dim=0)
            state[f"layers.{i}.{ours}"] = t.T if _is_matrix(ours) else t
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if hf:
        raise ValueError(f"unexpected tensors in {model_dir}: {sorted(hf)[:5]}")
    expected = dict(model.named_parameters())
    for name, t in state.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(t.shape)}, config implies "
                f"{tuple(expected[name].shape)}"
            )
    # assign=True adopts the tensors instead of copying into freshly allocated ones
    model.load_state_dict({k: v.contiguous() for k, v in state.items()}, strict=False, assign=True)
    return model.to(device=device, dtype=dtype)


def hf_state_dict(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor [out, in]) pairs for every weight of `model` (a LoRA policy's
    adapted matrices with their adapters merged: W + s * A @ B, in fp32)."""
    cfg = model.cfg
    yield "model.embed_tokens.weight", model.embed.T
    yield "model.norm.weight", model.norm
    if model.lm_head is not None:
        yield "lm_head.weight", model.lm_head.T
    for i, layer in enumerate(model.layers):
        for ours, theirs in hf_names(cfg, i).items():
            t = getattr(layer, ours)
            adapters = getattr(layer, "lora", None)  # (a plain view of tensors has none)
            merged = adapters.merged(ours, t) if adapters is not None else None
            t = t if merged is None else merged
            t = t.T if _is_matrix(ours) else t
            matrix = "wqkv" if ours == "bqkv" else ours
            sizes = parts(cfg, matrix) if matrix in MATRICES else [t.shape[0]]
            yield from zip(theirs, t.split(sizes, dim=0), strict=True)


def save_model(model: Transformer, out_dir: str | Path) -> Path:
    """Write config.json + model.safetensors in the layout transformers loads."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in hf_state_dict(model)}
    # atomic_path: whole or not at all, and readable by others (safetensors writes 0600)
    with atomic_path(out_dir / "model.safetensors") as tmp:
        save_file(tensors, tmp, metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(model.cfg.to_hf(), indent=2))
    return out_dir
