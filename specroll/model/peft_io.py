"""LoRA adapters as PEFT directories: `adapter_config.json` + `adapter_model.safetensors`.

What `peft.PeftModel.from_pretrained` loads onto the Hugging Face base model, and what a
run can start from (`lora.init`). A directory from elsewhere is data: JSON and safetensors
only, the config's size bounded, every tensor's name and shape checked against the policy
(from the safetensors header, before a byte of weights is read), so that an adapter for
another base or other targets is refused with one line that says what differs.

Names: PEFT's `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` is
`layers.{i}.lora.A.q_proj` transposed (PEFT stores [r, in] and [out, r]; specroll [in, r]
and [r, out]).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specroll.inputs import check_finite, read_json, shown
from specroll.model import lora
from specroll.model.config import ModelConfig
from specroll.model.lora import ATTENTION, MAX_ALPHA, TARGETS, LoraSpec, shape
from specroll.outputs import atomic_path

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 16
"""An adapter_config.json is a few hundred bytes: larger is not one."""
PREFIX = "base_model.model.model.layers."
UNSUPPORTED = {
    "use_rslora": False,
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "modules_to_save": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}
"""adapter_config.json fields whose other values change what an adapter computes, with
the one value read here (absent fields take it too)."""


def peft_name(layer: int, target: str, which: str) -> str:
    """PEFT's tensor name of an adapter ('A' or 'B') of `target` in layer `layer`."""
    part = "self_attn" if target in ATTENTION else "mlp"
    return f"{PREFIX}{layer}.{part}.{target}.lora_{which}.weight"


def base_name(model_dir: str | Path) -> str:
    """The name an adapter records as its base: config.json's `_name_or_path`, else the
    model directory's name."""
    model_dir = Path(model_dir)
    try:
        name = read_json(model_dir / "config.json", "model config").get("_name_or_path")
    except (ValueError, AttributeError):
        name = None
    return str(name) if name else model_dir.name


def _same_base(a: str, b: str) -> bool:
    """Whether two base names name one model (the last path part, case aside: a hub id
    and the local directory it was saved to agree)."""
    return Path(a).name.lower() == Path(b).name.lower()


def read_spec(adapter_dir: str | Path) -> tuple[LoraSpec, str]:
    """(the adapters' shape, their base model's name) from `adapter_dir`'s config; one-line
    ValueError naming the field for anything this reader cannot apply."""
    d = Path(adapter_dir)
    path = d / CONFIG
    if not path.is_file() or not (d / WEIGHTS).is_file():
        raise ValueError(
            f"lora.init={d}: not a PEFT adapter directory (needs {CONFIG} and {WEIGHTS})"
        )
    try:
        raw = read_json(path, "adapter config", MAX_CONFIG_BYTES)
    except ValueError as e:
        raise ValueError(f"lora.init: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"lora.init: {path} must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora.init: {path} has peft_type {raw.get('peft_type')!r}, not LORA")
    for key, value in UNSUPPORTED.items():
        if raw.get(key) is not None and raw.get(key) != value:
            raise ValueError(
                f"lora.init: {path} sets {key}={raw.get(key)!r}; specroll applies only {value!r}"
            )
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"lora.init: {path} target_modules must be a list of projection names")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(
            f"lora.init: {path} adapts {unknown[0]!r}, which specroll does not adapt "
            f"(targets: {', '.join(TARGETS)})"
        )
    r, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ValueError(f"lora.init: {path} r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha <= MAX_ALPHA:
        raise ValueError(
            f"lora.init: {path} lora_alpha must be a number in (0, {MAX_ALPHA}], got {shown(alpha)}"
        )
    dropout = raw.get("lora_dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"lora.init: {path} lora_dropout must be in [0, 1), got {dropout!r}")
    spec = LoraSpec(
        rank=r,
        alpha=float(alpha),
        targets=tuple(t for t in TARGETS if t in targets),
        dropout=float(dropout),
    )
    return spec, str(raw.get("base_model_name_or_path") or "")


def check(adapter_dir: str | Path, cfg: ModelConfig, base: str) -> LoraSpec:
    """The adapters' shape, once `adapter_dir` is known to fit a policy of config `cfg`
    named `base`: same base name, a rank that fits, and exactly the tensors its targets
    need, of this model's shapes (read from the safetensors header: nothing loaded)."""
    d = Path(adapter_dir)
    spec, theirs = read_spec(d)
    if theirs and base and not _same_base(theirs, base):
        raise ValueError(
            f"lora.init={d} is an adapter for {theirs!r}; this run's policy is {base!r}"
        )
    try:
        spec.check(cfg)
    except ValueError as e:
        raise ValueError(f"lora.init={d}: {e}") from None
    expected = {}
    for i in range(cfg.num_layers):
        for t in spec.targets:
            fan_in, fan_out = shape(cfg, t)
            expected[peft_name(i, t, "A")] = (spec.rank, fan_in)
            expected[peft_name(i, t, "B")] = (fan_out, spec.rank)
    try:
        with safe_open(d / WEIGHTS, "pt") as f:
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (a safe_open, not a dict)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"lora.init: {d / WEIGHTS} is not a safetensors file ({e})") from None
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ValueError(
            f"lora.init: {d / WEIGHTS} holds {extra[0]!r}, which adapters of {list(spec.targets)} "
            f"on a {cfg.num_layers}-layer policy do not have"
        )
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ValueError(f"lora.init: {d / WEIGHTS} lacks {missing[0]!r}")
    for k, s in expected.items():
        if found[k] != s:
            raise ValueError(
                f"lora.init: {k} in {d / WEIGHTS} has shape {list(found[k])}; this policy "
                f"needs {list(s)} (an adapter for another base model)"
            )
    return spec


def load(adapter_dir: str | Path, cfg: ModelConfig, spec: LoraSpec) -> dict[str, torch.Tensor]:
    """The adapter tensors of a `check`ed directory, by specroll name, fp32 [in, r] / [r, out]."""
    out = {}
    with safe_open(Path(adapter_dir) / WEIGHTS, "pt") as f:
        for i in range(cfg.num_layers):
            for t in spec.targets:
                for which in "AB":
                    name = peft_name(i, t, which)
                    w = f.get_tensor(name).to(torch.float32)
                    check_finite([(name, w)], f"lora.init: {Path(adapter_dir) / WEIGHTS}")
                    out[f"layers.{i}.lora.{which}.{t}"] = w.T.contiguous()
    return out


def base_of(model: str) -> str:
    """`base_name` of a run's `policy.model` (an alias, a directory or a .gguf)."""
    from specroll.model.hub import resolve

    return base_name(resolve(model))


def save(policy: torch.nn.Module, out_dir: str | Path, base: str) -> Path:
    """Write `policy`'s adapters as a PEFT LoRA directory for the base `base`."""
    spec = policy.lora_spec
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in lora.adapters(policy).items():
        _, i, _, which, target = name.split(".")
        tensors[peft_name(int(i), target, which)] = t.detach().to(torch.float32).T.contiguous()
    with atomic_path(out / WEIGHTS) as tmp:  # (safetensors alone writes mode 0600)
        save_file(tensors, tmp, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": list(spec.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "modules_to_save": None,
    }
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    return out
