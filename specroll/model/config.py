"""Model configuration for the Llama family (Llama, Qwen2, Qwen3, SmolLM2).

One dataclass describes every supported architecture; the differences between them are
three switches (`attention_bias`, `qk_norm`, `tie_word_embeddings`) plus the RoPE fields.
`from_hf` reads a transformers `config.json` (4.x and 5.x spellings of the RoPE fields)
and `to_hf` writes one that transformers loads back.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specroll.inputs import shown

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SIZE_LIMITS = {
    "vocab_size": 1 << 21,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "num_layers": 1024,
    "num_heads": 1024,
    "num_kv_heads": 1024,
    "head_dim": 4096,
    "max_position_embeddings": 1 << 24,
}
"""The largest value each size of a config may take, checked before any tensor is made.
Each is several times the largest published model's (vocabularies of 262k, widths of
16k, 53k-wide MLPs, 126 layers, 128 heads of 256, 10M-token windows): a config.json from
elsewhere sizes every tensor of a model, so a forged one must not allocate what it says."""
HF_SIZE_NAMES = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads"}
HF_SIZE_NAMES |= {"num_key_value_heads": "num_kv_heads"}
HF_SIZE_NAMES |= {k: k for k in SIZE_LIMITS if k not in HF_SIZE_NAMES.values()}
"""config.json's name of each bounded size → ours."""
MAX_DRAFT_SHARE = 2
"""A draft's layers may hold at most this many times its target's parameters (EAGLE-3 is
one layer; MTP one layer per head): a draft config from elsewhere sizes tensors before
any weight is read, so it is checked against the target first."""


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    model_type: str = "llama"
    """One of llama, qwen2, qwen3 (SmolLM2 is llama)."""
    vocab_size: int = 256
    """Number of token ids."""
    hidden_size: int = 64
    """Residual stream width H."""
    intermediate_size: int = 128
    """SwiGLU inner width."""
    num_layers: int = 2
    """Number of decoder layers."""
    num_heads: int = 4
    """Query heads."""
    num_kv_heads: int = 2
    """Key/value heads (GQA when fewer than num_heads)."""
    head_dim: int = 0
    """Per-head width; 0 means hidden_size // num_heads."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE scaling parameters (rope_type linear / llama3 / yarn), None for plain RoPE."""
    max_position_embeddings: int = 2048
    """Context window in tokens."""
    tie_word_embeddings: bool = True
    """LM head shares the embedding matrix."""
    attention_bias: bool = False
    """Bias on q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence id, if any."""
    eos_token_id: list[int] = field(default_factory=list)
    """End-of-sequence ids (generation stops on any)."""

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; allowed: {sorted(ARCHITECTURES)}"
            )
        for name, limit in SIZE_LIMITS.items():
            bounded_size(name, getattr(self, name), limit, zero=name == "head_dim")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"{name}={v!r} must be a finite number > 0")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must be >= 1 and divide "
                f"num_heads={self.num_heads}"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError("hidden_size must be divisible by num_heads when head_dim is 0")
            self.head_dim = self.hidden_size // self.num_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise ValueError(f"rope_type={kind!r} is not supported; allowed: {ROPE_TYPES}")
            if kind == "default":
                self.rope_scaling = None
            else:
                factor = self.rope_scaling.get("factor", 1.0)
                if isinstance(factor, bool) or not isinstance(factor, (int, float)):
                    raise ValueError(f"rope_scaling.factor={factor!r} must be a number")
                if not 0 < factor < math.inf:
                    raise ValueError(f"rope_scaling.factor={factor!r} must be finite and > 0")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        self.eos_token_id = list(self.eos_token_id or [])
        for t in self.eos_token_id:
            bounded_size("eos_token_id", t, self.vocab_size - 1, zero=True)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        H, inter = self.hidden_size, self.intermediate_size
        attn = H * (self.q_size + 2 * self.kv_size) + self.q_size * H
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        layer = attn + 3 * H * inter + 2 * H + (2 * self.head_dim if self.qk_norm else 0)
        emb = self.vocab_size * H * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + H

    # ------------------------------------------------------------------ HF interop

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a transformers config.json dict (4.x or 5.x RoPE spelling); every
        size is bounded first (`SIZE_LIMITS`), and a ValueError names `source` and the
        field."""
        try:
            return cls._from_hf(hf)
        except (ValueError, TypeError, KeyError) as e:
            what = f"lacks the field {e}" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"{source}: {what}") from None

    @classmethod
    def _from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        if not isinstance(hf, dict):
            raise ValueError(f"holds a {type(hf).__name__}, not a JSON object")
        for theirs, ours in HF_SIZE_NAMES.items():
            if hf.get(theirs) is not None:
                bounded_size(theirs, hf[theirs], SIZE_LIMITS[ours], zero=False)
        model_type = hf.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"config.json model_type={model_type!r} is not supported; "
                f"allowed: {sorted(ARCHITECTURES)}"
            )
        rope = dict(hf.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        if not rope and hf.get("rope_scaling"):
            rope = dict(hf["rope_scaling"])
        kind = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if kind == "default" else {**rope, "rope_type": kind}
        if hf.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        eos = hf.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or 0,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", model_type == "llama"),
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=[] if eos is None else eos,
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that transformers 5.x (and 4.x) load."""
        rope = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        eos = self.eos_token_id[0] if len(self.eos_token_id) == 1 else (self.eos_token_id or None)
        out = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": "float32",
            "dtype": "float32",
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        if self.model_type == "qwen3":
            out["attention_bias"] = self.attention_bias
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies per rotary pair ([head_dim // 2], fp32) and the cos/sin scale.

    Computed in fp32 the way transformers does, so long positions round identically,
    with the published formula of each rope_type (linear, llama3, yarn).
    """
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv, 1.0
    kind, factor = s["rope_type"], float(s["factor"])
    if kind == "linear":
        return inv / factor, 1.0
    old = s.get("original_max_position_embeddings") or cfg.max_position_embeddings
    if kind == "llama3":
        lo, hi = s["low_freq_factor"], s["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn: blend interpolated and extrapolated frequencies with a linear ramp
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = inv / factor * (1 - extrapolation) + inv * extrapolation
    mscale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, float(mscale)


def bounded_size(name: str, value: Any, limit: int, zero: bool = False) -> None:
    """ValueError naming `name` unless `value` is an integer in 1..limit (0..limit with
    `zero`, for a size where 0 means "derived"); JSON's 1e10 is a float and refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={shown(value)} must be an integer")
    if not (0 if zero else 1) <= value <= limit:
        raise ValueError(
            f"{name}={shown(value)} is out of range; allowed: {int(not zero)}..{limit}"
        )


def check_draft_size(layer: ModelConfig, target: ModelConfig, what: str) -> None:
    """ValueError naming `what` when a draft whose decoder layers are `layer` would hold
    more than MAX_DRAFT_SHARE times the parameters of its target (checked before the
    draft's tensors are allocated)."""
    n, limit = layer.num_params(), MAX_DRAFT_SHARE * target.num_params()
    if n > limit:
        raise ValueError(
            f"{what} describes a draft of {n:.3g} parameters, more than {MAX_DRAFT_SHARE}x its "
            f"target's {target.num_params():.3g}: not a draft of this policy"
        )
