"""MTP weights: specroll's own heads (config.json + mtp.safetensors) and the native MTP
modules of Qwen3-Next and DeepSeek-V3 checkpoints (naming in `specroll.drafters.mtp`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specroll.drafting.eagle3_io import read_config, read_tensors
from specroll.drafting.mtp_heads import MATRICES, MTPConfig, MTPDraft
from specroll.inputs import check_finite, regular, regular_entries
from specroll.model.config import ModelConfig
from specroll.model.transformer import Transformer
from specroll.model.weights import hf_names
from specroll.outputs import atomic_path, write_text


def save_mtp(draft: MTPDraft, out_dir: str | Path) -> Path:
    """Write config.json + mtp.safetensors (the heads only; the target is not copied)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in draft.state_dict().items()}
    with atomic_path(out_dir / "mtp.safetensors") as tmp:  # whole or not at all
        save_file(tensors, tmp, metadata={"format": "pt"})
    write_text(out_dir / "config.json", json.dumps(draft.cfg.to_dict(), indent=2))
    return out_dir


def _fill(draft: MTPDraft, state: dict[str, torch.Tensor], where: object) -> MTPDraft:
    expected = dict(draft.named_parameters())
    for name, p in expected.items():
        if name not in state:
            raise ValueError(f"weights in {where} lack tensor {name!r}")
        if state[name].shape != p.shape:
            raise ValueError(
                f"tensor {name!r} in {where} has shape {tuple(state[name].shape)}, "
                f"expected {tuple(p.shape)}"
            )
    if extra := sorted(set(state) - set(expected)):
        raise ValueError(f"unexpected tensors in {where}: {extra[:5]}")
    with torch.no_grad():
        for name, p in expected.items():
            p.copy_(state[name])
    return draft


def load_mtp(model_dir: str | Path, target: Transformer) -> MTPDraft:
    """Load heads written by `save_mtp` on top of `target`."""
    model_dir = Path(model_dir)
    hf = read_config(model_dir)
    try:
        cfg = MTPConfig(**hf)
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{model_dir / 'config.json'} is not a specroll MTP config: {e}") from e
    state = read_tensors([model_dir / "mtp.safetensors"])
    return _fill(MTPDraft(cfg, target), state, model_dir)


def _sizes(cfg: ModelConfig, ours: str, n: int) -> list[int]:
    """How HF splits the rows ([out, in] layout) of our fused parameter `ours`."""
    if ours in ("wqkv", "bqkv"):
        return [cfg.q_size, cfg.kv_size, cfg.kv_size]
    return [cfg.intermediate_size] * 2 if ours == "w_gate_up" else [n]


def _native_names(naming: str, cfg: MTPConfig, L: int) -> dict[str, list[str]]:
    """Our parameter → the HF tensors it is made of, in concatenation order."""
    plan: dict[str, list[str]] = {}
    for i in range(cfg.num_heads_mtp):
        if naming == "qwen3_next":  # fc and the three norms are shared by all mtp.layers
            own = ["mtp." + s for s in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc")]
            own.append("mtp.norm")
            layer = {
                k: [s.replace("model.", "mtp.", 1) for s in v]
                for k, v in hf_names(cfg.layer, i).items()
            }
        else:
            p = f"model.layers.{L + i}."
            own = [p + s for s in ("enorm", "hnorm", "eh_proj", "shared_head.norm")]
            layer = hf_names(cfg.layer, L + i)
        for ours, theirs in zip(("enorm", "hnorm", "eh_proj", "final_norm"), own, strict=True):
            plan[f"heads.{i}.{ours}"] = [theirs + ".weight"]
        plan.update({f"heads.{i}.block.{k}": v for k, v in layer.items()})
    return plan


def _native_heads(where: dict, naming: str, L: int, model_dir: Path) -> tuple[str, int]:
    """(naming, number of heads) of a checkpoint whose tensor names are `where`'s keys,
    on a target of L layers ("auto": the naming its tensors use)."""
    if naming == "auto":
        if any(k.startswith("mtp.") for k in where):
            naming = "qwen3_next"
        elif f"model.layers.{L}.eh_proj.weight" in where:
            naming = "deepseek_v3"
        else:
            raise ValueError(f"{model_dir} has no native MTP tensors (mtp.* or layers.{L}.*)")
    if naming == "qwen3_next":
        idx = [int(m.group(1)) for k in where if (m := re.match(r"mtp\.layers\.(\d+)\.", k))]
        return naming, max(idx, default=0) + 1
    if naming == "deepseek_v3":
        n = 1
        while f"model.layers.{L + n}.eh_proj.weight" in where:
            n += 1
        return naming, n
    raise ValueError(f"naming={naming!r}; allowed: auto, qwen3_next, deepseek_v3")


def load_native_mtp(
    model_dir: str | Path,
    target: Transformer,
    naming: str = "auto",
    norm_offset: float | None = None,
) -> MTPDraft:
    """Native MTP heads from a HF checkpoint dir (safetensors only).

    naming: "qwen3_next", "deepseek_v3" or "auto" (by which tensors exist); the number of
    heads is read from the tensor names. norm_offset is added to every norm weight; None
    = 1.0 when config.json says qwen3_next / qwen3_5 (Gemma-style norms), else 0.0.
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weight files")
    handles, where = {}, {}  # file → reader; tensor name → file
    regular_entries(model_dir, "model directory")
    for f in files:
        try:
            handles[f] = safe_open(regular(f, "weight file"), "pt")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"weight file {f} is corrupt or unreadable: {e}") from e
        where.update(dict.fromkeys(handles[f].keys(), f))
    L = target.cfg.num_layers
    naming, n = _native_heads(where, naming, L, model_dir)
    try:  # n comes from the tensor names: bounded before anything is allocated
        cfg = MTPConfig.for_target(
            target.cfg, n, own_final_norm=True, feed_back_normed=naming == "qwen3_next"
        )
        draft = MTPDraft(cfg, target)
    except ValueError as e:
        raise ValueError(f"{model_dir}: {n} MTP heads named in its weights: {e}") from None
    if norm_offset is None:
        hf_cfg = model_dir / "config.json"
        mt = read_config(model_dir).get("model_type", "") if hf_cfg.is_file() else ""
        norm_offset = 1.0 if mt.startswith(("qwen3_next", "qwen3_5")) else 0.0

    plan = _native_names(naming, cfg, L)
    params = dict(draft.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for ours, theirs in plan.items():
        leaf, p = ours.rsplit(".", 1)[-1], params[ours]
        ref = p.T if leaf in MATRICES else p  # the fused parameter in HF layout
        parts = []
        for name, size in zip(theirs, _sizes(cfg.layer, leaf, ref.shape[0]), strict=True):
            if name not in where:
                raise ValueError(f"weights in {model_dir} lack tensor {name!r}")
            t = handles[where[name]].get_tensor(name)
            if tuple(t.shape) != (want := (size, *ref.shape[1:])):
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {want}")
            check_finite([(name, t)], where[name])
            parts.append(t.to(p.dtype))
        t = torch.cat(parts, dim=0)
        if leaf in MATRICES:
            t = t.T
        elif "norm" in leaf:
            t = t + norm_offset
        state[ours] = t

    used = {s for v in plan.values() for s in v}
    if naming == "qwen3_next":
        extra = [k for k in where if k.startswith("mtp.") and k not in used]
    else:  # any other tensor of a layer >= L, except DeepSeek's copies of the target's
        skip = (".embed_tokens.weight", ".shared_head.head.weight")
        ds = [(k, re.match(r"model\.layers\.(\d+)\.", k)) for k in where if k not in used]
        extra = [k for k, m in ds if m and int(m.group(1)) >= L and not k.endswith(skip)]
    if extra:
        raise ValueError(f"unexpected MTP tensors in {model_dir}: {sorted(extra)[:5]}")
    return _fill(draft, state, model_dir)
