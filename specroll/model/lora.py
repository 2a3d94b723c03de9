"""LoRA adapters on the decoder's projections: what trains when `lora.rank` > 0.

An adapted projection computes `x @ W + s * (x @ A) @ B` with the base `W` frozen, `A`
[in, r], `B` [r, out] and `s = alpha / r` (input-major like the weights: PEFT's
`lora_A.weight` is `A.T`, `lora_B.weight` is `B.T`). Targets are named as Hugging Face
and PEFT name the projections; specroll's fused matrices are adapted as their parts
(q_proj, k_proj and v_proj are three adapters on the column blocks of `wqkv`; gate_proj
and up_proj two on `w_gate_up`), which is what makes an adapter trained here a PEFT
adapter of the Hugging Face model, and the other way round.

Two ways to serve an adapted policy (`Served`): the adapters in the forward (the very
operations of the learner: its log-probs to float rounding of the packed product), or
merged into the engine's own weights at each refit, `W = W_base + s * A @ B` from a kept
copy of the base (never by subtracting the last delta: that would drift). Either way a
refit carries only the adapters.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specroll.inputs import shown
from specroll.model.config import ModelConfig

TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("wqkv", 0),
    "k_proj": ("wqkv", 1),
    "v_proj": ("wqkv", 2),
    "o_proj": ("wo", 0),
    "gate_proj": ("w_gate_up", 0),
    "up_proj": ("w_gate_up", 1),
    "down_proj": ("w_down", 0),
}
"""Target name (Hugging Face / PEFT) -> (specroll matrix, which column block of it)."""
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL = "all-linear"
"""`lora.targets` shorthand for every projection (PEFT's name for it)."""
KEY = ".lora."
"""What every adapter tensor's name holds (`layers.{i}.lora.{A|B}.{target}`)."""


def parts(cfg: ModelConfig, matrix: str) -> list[int]:
    """The output widths of a matrix's column blocks, in order."""
    return {
        "wqkv": [cfg.q_size, cfg.kv_size, cfg.kv_size],
        "wo": [cfg.hidden_size],
        "w_gate_up": [cfg.intermediate_size] * 2,
        "w_down": [cfg.hidden_size],
    }[matrix]


def shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(in, out) of a target projection."""
    matrix, part = TARGETS[target]
    fan_in = {
        "wqkv": cfg.hidden_size,
        "wo": cfg.q_size,
        "w_gate_up": cfg.hidden_size,
        "w_down": cfg.intermediate_size,
    }[matrix]
    return fan_in, parts(cfg, matrix)[part]


def expand_targets(targets: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """`targets` in `TARGETS` order ('all-linear' = every projection); ValueError naming
    an unknown one and the allowed names."""
    names = set(TARGETS) if ALL in targets else set(targets)
    unknown = sorted(names - set(TARGETS))
    if unknown:
        raise ValueError(
            f"lora.targets: unknown target {unknown[0]!r}; allowed: {', '.join(TARGETS)} or {ALL!r}"
        )
    if not names:
        raise ValueError(f"lora.targets is empty; allowed: {', '.join(TARGETS)} or {ALL!r}")
    return tuple(t for t in TARGETS if t in names)


MAX_ALPHA = 65536.0
"""Largest lora_alpha (the scale's numerator) accepted from a setting or an adapter file:
far above any published recipe's, and a bound that keeps alpha / r finite."""


@dataclass(frozen=True)
class LoraSpec:
    """The shape of a policy's adapters (what a replica or a checkpoint rebuilds them from)."""

    rank: int
    """r: the adapters' inner width."""
    alpha: float
    """The scale numerator: adapters add alpha / r * (x A) B."""
    targets: tuple[str, ...]
    """Adapted projections, in `TARGETS` order."""
    dropout: float = 0.0
    """Dropout on the adapters' input in the train forward (PEFT's lora_dropout)."""

    def __post_init__(self) -> None:
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a <= MAX_ALPHA:
            raise ValueError(f"lora.alpha must be a number in (0, {MAX_ALPHA:g}], got {shown(a)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def check(self, cfg: ModelConfig) -> None:
        """ValueError when the rank does not fit a target of this model (rank <= 0, or
        larger than the projection's smaller side: then it is not low-rank)."""
        if self.rank <= 0:
            raise ValueError(f"lora.rank must be > 0 for adapters, got {self.rank}")
        for t in self.targets:
            fan_in, fan_out = shape(cfg, t)
            if self.rank > min(fan_in, fan_out):
                raise ValueError(
                    f"lora.rank={self.rank} is larger than {t} of this model "
                    f"({fan_out} x {fan_in}): at most {min(fan_in, fan_out)}"
                )


class LayerLoRA(nn.Module):
    """One decoder layer's adapters: `A[t]` [in, r] and `B[t]` [r, out] per target."""

    def __init__(self, cfg: ModelConfig, spec: LoraSpec) -> None:
        super().__init__()
        self.spec = spec
        self.A = nn.ParameterDict()
        self.B = nn.ParameterDict()
        for t in spec.targets:
            fan_in, fan_out = shape(cfg, t)
            self.A[t] = nn.Parameter(torch.empty(fan_in, spec.rank))
            self.B[t] = nn.Parameter(torch.zeros(spec.rank, fan_out))
        self._blocks: dict[str, list[tuple[str | None, int]]] = {}
        """matrix -> its column blocks as (target or None, width)."""
        for matrix in ("wqkv", "wo", "w_gate_up", "w_down"):
            names = {p: t for t, (m, p) in TARGETS.items() if m == matrix and t in spec.targets}
            if names:
                widths = parts(cfg, matrix)
                self._blocks[matrix] = [(names.get(p), w) for p, w in enumerate(widths)]

    def reset(self, generator: torch.Generator) -> None:
        """PEFT's initialisation: A uniform in +-1/sqrt(in) (Kaiming, a=sqrt(5)), B zero,
        so that a fresh adapter leaves the policy as it was."""
        with torch.no_grad():
            for t in self.A:
                bound = 1.0 / math.sqrt(self.A[t].shape[0])
                self.A[t].uniform_(-bound, bound, generator=generator)
                self.B[t].zero_()

    def delta(self, matrix: str) -> torch.Tensor | None:
        """s * A @ B laid out as `matrix` ([in, out], zero in blocks no target adapts);
        None when no target adapts it (merging)."""
        blocks = self._blocks.get(matrix)
        if blocks is None:
            return None
        s = self.spec.scale
        ref = self.A[next(t for t, _ in blocks if t is not None)]  # [in, r]
        cols = [
            s * (self.A[t] @ self.B[t]) if t is not None else ref.new_zeros(ref.shape[0], w)
            for t, w in blocks
        ]
        return torch.cat(cols, dim=1)

    def merged(self, matrix: str, w: torch.Tensor) -> torch.Tensor | None:
        """`w` (the base of `matrix`) + s * A @ B in fp32: the one merge every path
        uses (export, `merge`, `Served`); None when no target adapts `matrix`."""
        delta = self.delta(matrix)
        return None if delta is None else w.detach().float() + delta.detach().float()

    def add(self, matrix: str, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + the adapters' contribution to `matrix`'s product of h ([.., in] -> [.., out])."""
        blocks = self._blocks.get(matrix)
        if blocks is None:
            return y
        p = self.spec.dropout
        if p > 0 and self.training and torch.is_grad_enabled():
            h = F.dropout(h, p)
        s = self.spec.scale
        if len(blocks) == 1:
            t = blocks[0][0]
            return y + s * ((h @ self.A[t]) @ self.B[t])
        cols = [
            s * ((h @ self.A[t]) @ self.B[t]) if t is not None else y.new_zeros(*y.shape[:-1], w)
            for t, w in blocks
        ]
        return y + torch.cat(cols, dim=-1)


def attach(model: nn.Module, spec: LoraSpec, seed: int = 0) -> nn.Module:
    """Give every layer of `model` (a `Transformer`) fresh adapters (`LayerLoRA.reset`,
    from `seed`) and freeze its base weights: only adapters train."""
    spec.check(model.cfg)
    g = torch.Generator().manual_seed(seed)
    model.requires_grad_(False)
    for block in model.layers:
        block.lora = LayerLoRA(model.cfg, spec)
        block.lora.reset(g)
        ref = block.wqkv
        block.lora.to(device=ref.device, dtype=ref.dtype)
    model.lora_spec = spec
    return model


def adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of `model` by name (detached views); empty without adapters."""
    return {k: v.detach() for k, v in model.state_dict().items() if is_adapter(k)}


def is_adapter(name: str) -> bool:
    return KEY in name


@contextmanager
def disabled(model: nn.Module) -> Iterator[nn.Module]:
    """`model` without its adapters for the duration: the base policy, e.g. as the KL
    reference of a run whose adapters started at zero (no copy of the base needed)."""
    held = [block.lora for block in model.layers]
    for block in model.layers:
        block.lora = None
    try:
        yield model
    finally:
        for block, adapters in zip(model.layers, held, strict=True):
            block.lora = adapters


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """`model` with its adapters merged into its base weights, in place, and removed
    (export; `Served` merges from a kept base instead)."""
    for block in model.layers:
        lora = block.lora
        if lora is None:
            continue
        for matrix in lora._blocks:
            w = getattr(block, matrix)
            w.copy_(lora.merged(matrix, w))
        block.lora = None
    model.lora_spec = None
    return model


class Served:
    """How an engine's copy of an adapted policy takes a refit of adapters.

    merged: the engine's layers hold no adapters; the base of every adapted matrix is
    kept aside (fp32), and a refit writes `base + s * A @ B` into the engine's weights
    (which the engine then prepacks, as for any refit). adapters: the engine's layers
    keep their adapters and a refit copies them in (the forward adds them, as the
    learner's does)."""

    def __init__(self, model: nn.Module, merged: bool) -> None:
        self.merged = merged
        self.device: torch.device | None = None
        """Where the engine's weights are (its owner sets it once they are placed);
        None: where the adapters come from."""
        self.layers: list[LayerLoRA] = []
        self.base: dict[str, torch.Tensor] = {}
        if not merged:
            return
        for i, block in enumerate(model.layers):
            lora, block.lora = block.lora, None
            self.layers.append(lora.eval().requires_grad_(False))
            for matrix in lora._blocks:
                self.base[f"layers.{i}.{matrix}"] = getattr(block, matrix).detach().float().clone()
        model.lora_spec = None

    @torch.no_grad()
    def state(self, adapter_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors the engine loads for a refit of `adapter_state` (names of the
        adapters; merged: of the adapted matrices, computed where the engine's weights
        are: the kept base moves there on the first refit)."""
        if not self.merged:
            return adapter_state
        if self.base:
            device = next(iter(adapter_state.values())).device if adapter_state else None
            self._to(self.device or device)
        for name, t in adapter_state.items():
            i, rest = _split(name)
            self.layers[i].get_parameter(rest).copy_(t)
        out = {}
        for name, base in self.base.items():
            i, matrix = _split(name)
            out[name] = self.layers[i].merged(matrix, base)
        return out

    def _to(self, device: torch.device | None) -> None:
        if device is None or next(iter(self.base.values())).device == device:
            return
        self.base = {k: v.to(device) for k, v in self.base.items()}
        for layer in self.layers:
            layer.to(device)


def _split(name: str) -> tuple[int, str]:
    """'layers.3.lora.A.q_proj' -> (3, 'A.q_proj'); 'layers.3.wqkv' -> (3, 'wqkv')."""
    _, i, rest = name.split(".", 2)
    return int(i), rest.removeprefix("lora.")
