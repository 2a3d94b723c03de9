"""EAGLE-3 checkpoints: specroll's own layout (which is vLLM's), SpecForge's export and
the vLLM-ready directories published for other models, read and written here; the
network is `specroll.drafters.eagle3`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specroll.drafting.eagle3_head import Eagle3Config, Eagle3Head, Embed
from specroll.inputs import check_finite, read_json, regular, regular_entries
from specroll.model.config import ModelConfig, check_draft_size
from specroll.model.transformer import Transformer
from specroll.outputs import atomic_path, write_text


def hf_tensors(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """Our parameters under SpecForge's export names ([out, in] weights, HF convention)."""
    c = head.cfg.layer
    q, k, v = head.wqkv.detach().split([c.q_size, c.kv_size, c.kv_size], dim=1)
    gate, up = head.w_gate_up.detach().chunk(2, dim=1)
    named = {
        "fc.weight": head.fc.detach().T,
        "midlayer.hidden_norm.weight": head.hidden_norm.detach(),
        "midlayer.input_layernorm.weight": head.input_layernorm.detach(),
        "midlayer.self_attn.q_proj.weight": q.T,
        "midlayer.self_attn.k_proj.weight": k.T,
        "midlayer.self_attn.v_proj.weight": v.T,
        "midlayer.self_attn.o_proj.weight": head.wo.detach().T,
        "midlayer.post_attention_layernorm.weight": head.post_attention_layernorm.detach(),
        "midlayer.mlp.gate_proj.weight": gate.T,
        "midlayer.mlp.up_proj.weight": up.T,
        "midlayer.mlp.down_proj.weight": head.w_down.detach().T,
        "norm.weight": head.norm.detach(),
        "lm_head.weight": head.lm_head.detach().T,
        "d2t": head.d2t,
        "t2d": head.t2d,
    }
    return {n: t.contiguous().cpu() for n, t in named.items()}


def save_eagle3(head: Eagle3Head, out_dir: str | Path) -> None:
    """Write config.json + model.safetensors in the SpecForge / vLLM EAGLE-3 layout."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # each file whole or not at all: an interrupted save never leaves half a checkpoint
    with atomic_path(out / "model.safetensors") as tmp:
        save_file(hf_tensors(head), str(tmp), metadata={"format": "pt"})
    write_text(out / "config.json", json.dumps(head.cfg.to_hf(), indent=2) + "\n")


def read_config(path: Path) -> dict[str, Any]:
    """`path`/config.json as a dict; ValueError naming the file when it is not a regular
    file, not JSON or not an object (a list, a string). Every plain entry of `path` must
    be a regular file (`files.regular_entries`): a FIFO would block a native reader."""
    f = Path(path) / "config.json"
    if Path(path).is_dir():
        regular_entries(path, "draft directory")
    hf = read_json(f, "draft config")
    if not isinstance(hf, dict):
        raise ValueError(f"draft config {f} holds a {type(hf).__name__}, not a JSON object")
    return hf


def read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """The tensors of safetensors `files`; ValueError naming a truncated or corrupt one,
    or one holding a NaN or an infinity."""
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            got = load_file(str(regular(f, "draft weight file")))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"weight file {f} is truncated or corrupt ({e})") from e
        check_finite(got.items(), f)
        raw.update(got)
    return raw


def _check(hf: dict[str, Any], name: str, want: Any, what: str) -> None:
    if hf.get(name, want) != want:
        raise ValueError(f"EAGLE-3 config {name}={hf.get(name)!r} but {what} needs {want!r}")


def config_from_hf(
    hf: dict[str, Any], target_cfg: ModelConfig, source: str = "the EAGLE-3 config"
) -> Eagle3Config:
    """The head's architecture from its config.json dict (SpecForge's, vLLM's or
    `Eagle3Config.to_hf`), checked against the target's; ValueError naming `source` (the
    file) and the field."""
    try:
        return _config_from_hf(hf, target_cfg, source)
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith(source) else f"{source}: {e}") from None


def _config_from_hf(hf: dict[str, Any], target_cfg: ModelConfig, source: str) -> Eagle3Config:
    _check(hf, "hidden_size", target_cfg.hidden_size, "the target")
    _check(hf, "target_hidden_size", target_cfg.hidden_size, "the target")
    _check(hf, "vocab_size", target_cfg.vocab_size, "the target")
    _check(hf, "num_hidden_layers", 1, "this EAGLE-3 head")
    for flag in ("attention_bias", "mlp_bias"):
        _check(hf, flag, False, "this EAGLE-3 head")
    if not (hf.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        raise ValueError("eagle_config.use_aux_hidden_state=false (no fc) is not supported")
    layer = ModelConfig.from_hf({**hf, "model_type": "llama"}, source)  # both RoPE spellings
    L = target_cfg.num_layers
    aux = hf.get("eagle_aux_hidden_state_layer_ids") or (2, L // 2, L - 3)
    if len(aux) != 3 or not all(0 <= i <= L for i in aux):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids={aux} invalid for {L} target layers")
    check_draft_size(layer, target_cfg, "the EAGLE-3 config")
    return Eagle3Config.from_layer(
        layer,
        hf.get("draft_vocab_size") or layer.vocab_size,
        aux,
        norm_before_residual=bool(hf.get("norm_before_residual", False)),
    )


def load_eagle3(
    path: str | Path, target_cfg: ModelConfig, embed: Embed | Transformer | None = None
) -> Eagle3Head:
    """Read a head saved by `save_eagle3`, SpecForge or vLLM (`midlayer.*` or `layers.0.*`)."""
    path = Path(path)
    cfg = config_from_hf(read_config(path), target_cfg, str(path / "config.json"))
    head = Eagle3Head(cfg, embed)  # every parameter and buffer is overwritten below
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {path} (pickled checkpoints are not read)")
    raw = read_tensors(files)
    got: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        name = name.removeprefix("model.")
        if name.startswith("layers.0."):  # vLLM's module name; it maps midlayer. onto it
            name = "midlayer." + name.removeprefix("layers.0.")
        if name != "embed_tokens.weight":  # the target's embedding is used instead
            got[name] = t
    want = {n: t.shape for n, t in hf_tensors(head).items()}
    if "d2t" not in got and cfg.draft_vocab_size == cfg.vocab_size:
        got["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)  # vLLM: identity
    if "t2d" not in got and "d2t" in got:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + got["d2t"].long()] = True
        got["t2d"] = t2d
    missing, unknown = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or unknown:
        raise ValueError(f"EAGLE-3 checkpoint {path}: missing tensors {missing}, unknown {unknown}")
    for n, shape in want.items():
        if got[n].shape != shape:
            raise ValueError(f"tensor {n} has shape {tuple(got[n].shape)}, expected {tuple(shape)}")
    target_ids = torch.arange(cfg.draft_vocab_size) + got["d2t"].long()
    bad = int(target_ids.min()) < 0 or int(target_ids.max()) >= cfg.vocab_size
    if bad or target_ids.unique().numel() != cfg.draft_vocab_size:
        raise ValueError(f"d2t must map draft ids to distinct ids < vocab_size={cfg.vocab_size}")
    g = {n: t.float() if t.is_floating_point() else t for n, t in got.items()}
    a = "midlayer.self_attn."
    m = "midlayer.mlp."
    with torch.no_grad():
        head.fc.copy_(g["fc.weight"].T)
        head.hidden_norm.copy_(g["midlayer.hidden_norm.weight"])
        head.input_layernorm.copy_(g["midlayer.input_layernorm.weight"])
        head.wqkv.copy_(torch.cat([g[a + f"{p}_proj.weight"] for p in "qkv"]).T)
        head.wo.copy_(g[a + "o_proj.weight"].T)
        head.post_attention_layernorm.copy_(g["midlayer.post_attention_layernorm.weight"])
        head.w_gate_up.copy_(torch.cat([g[m + "gate_proj.weight"], g[m + "up_proj.weight"]]).T)
        head.w_down.copy_(g[m + "down_proj.weight"].T)
        head.norm.copy_(g["norm.weight"])
        head.lm_head.copy_(g["lm_head.weight"].T)
        head.d2t.copy_(g["d2t"].long())
        head.t2d.copy_(g["t2d"].bool())
    return head
