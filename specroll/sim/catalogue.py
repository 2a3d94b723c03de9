"""Model shapes and accelerator specs the simulator knows by name.

Models are the Qwen3 family the paper and peers report on, plus the embedded default;
any HF config.json can be read too. Hardware numbers are public per-GPU dense specs
(see ../shared/research/simulator.md §3); the efficiency factors say how much of the
peak a decode-time GEMM (`flop_eff`) and a weight/KV stream (`mem_eff`) reach, and are
the first thing a measured profile replaces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    """What the step-time model needs of a decoder."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    """Dense FFN width, or the width of one expert for MoE."""
    vocab: int
    experts: int = 0
    """Routed experts per layer (0 = dense)."""
    top_k: int = 0
    """Experts per token."""

    @property
    def attn_params(self) -> int:
        return self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim + (
            self.q_heads * self.head_dim * self.hidden
        )

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.ffn

    @property
    def params_total(self) -> int:
        ffn = self.expert_params * max(self.experts, 1)
        return self.layers * (self.attn_params + ffn) + 2 * self.vocab * self.hidden

    @property
    def params_active(self) -> int:
        ffn = self.expert_params * (self.top_k if self.experts else 1)
        return self.layers * (self.attn_params + ffn) + 2 * self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        """bf16 K and V of every layer."""
        return 2 * 2 * self.layers * self.kv_heads * self.head_dim

    @classmethod
    def from_config(cls, path: str | Path) -> ModelSpec:
        """Read a HF config.json (dense Llama/Qwen, or Qwen MoE fields)."""
        p = Path(path)
        f = p / "config.json" if p.is_dir() else p
        try:
            c = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"model config {f} is unreadable or not JSON ({e})") from e
        if not isinstance(c, dict):
            raise ValueError(f"model config {f} holds a {type(c).__name__}, not a JSON object")
        need = ("num_attention_heads", "num_hidden_layers", "hidden_size", "vocab_size")
        lacks = [k for k in need if k not in c]
        if "moe_intermediate_size" not in c and "intermediate_size" not in c:
            lacks.append("intermediate_size")
        if lacks:
            raise ValueError(f"model config {f} lacks {', '.join(lacks)} (a HF config.json)")
        heads = c["num_attention_heads"]
        return cls(
            name=c.get("_name_or_path") or p.stem,
            layers=c["num_hidden_layers"],
            hidden=c["hidden_size"],
            q_heads=heads,
            kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            ffn=c.get("moe_intermediate_size") or c["intermediate_size"],
            vocab=c["vocab_size"],
            experts=c.get("num_experts", 0) or 0,
            top_k=c.get("num_experts_per_tok", 0) or 0,
        )


MODELS: dict[str, ModelSpec] = {
    "qwen3-8b": ModelSpec("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936),
    "qwen3-32b": ModelSpec("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936),
    "qwen3-30b-a3b": ModelSpec("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 768, 151936, 128, 8),
    "qwen3-235b-a22b": ModelSpec("qwen3-235b-a22b", 94, 4096, 64, 4, 128, 1536, 151936, 128, 8),
    "smollm2-135m": ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152),
}


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator: peaks and the efficiency actually reached."""

    name: str
    flops: float
    """Dense bf16 FLOP/s."""
    mem_bw: float
    """HBM bytes/s."""
    link_bw: float
    """Bytes/s per direction within the NVLink domain."""
    domain: int
    """GPUs per NVLink domain."""
    mem_gb: float
    """HBM capacity."""
    flop_eff: float = 0.6
    """Share of peak FLOP/s a decode/verify GEMM reaches."""
    mem_eff: float = 0.8
    """Share of peak bandwidth a weight/KV stream reaches."""
    step_overhead: float = 3e-3
    """Fixed seconds per decode iteration (launches, scheduler, sampling)."""
    draft_overhead: float = 3e-4
    """Fixed seconds per drafter forward (one per draft token, plus the feature pass)."""


HARDWARE: dict[str, HardwareSpec] = {
    "h100": HardwareSpec("h100", 989e12, 3.35e12, 450e9, 8, 80),
    "h200": HardwareSpec("h200", 989e12, 4.8e12, 450e9, 8, 141),
    "b200": HardwareSpec("b200", 2250e12, 8.0e12, 900e9, 8, 180),
    "gb200": HardwareSpec("gb200", 2500e12, 8.0e12, 900e9, 72, 186),
}


def model_spec(name_or_path: str) -> ModelSpec:
    """A catalogue name or a config.json / model directory."""
    key = name_or_path.lower()
    if key in MODELS:
        return MODELS[key]
    p = Path(name_or_path)
    if p.exists():
        return ModelSpec.from_config(p)
    raise ValueError(f"model {name_or_path!r} is not one of {sorted(MODELS)} nor a config.json")


def hardware_spec(name: str) -> HardwareSpec:
    if name.lower() in HARDWARE:
        return HARDWARE[name.lower()]
    raise ValueError(f"hardware {name!r} is not one of {sorted(HARDWARE)} (or pass a profile)")
