"""The Llama-family decoder shared by the rollout engine and the learner.

One module, two call patterns, one set of numerics:

* learner: `model(tokens)` — full-sequence causal forward with autograd;
* engine:  `model(tokens, positions, cache)` — incremental forward where row b of the batch
  lives in cache slot b, starts at its own position `positions[b]` and appends `T` tokens
  (rows advance by different amounts; padded tail tokens are written but never attended).

Both paths run the same layer ops (`specroll.model.ops`) with an explicit mask, so the
engine's log-probs equal the learner's recomputation to float rounding (checked by a
test).

Weights are stored input-major (`[in, out]`, used as `x @ w`; with autograd this is the
faster plain-BLAS layout for few-row products). Grad-free CPU forwards (the engine) use
prepacked copies instead (MKL on Intel CPUs, oneDNN elsewhere: `specroll.model.packed`):
a packed product of a few rows costs about what one row costs, which is what makes
verifying k draft tokens cheap (`specroll bench engine`, field `verify_cost`, and
`benchmarks/gemm_stack.py` measure it on the machine at hand). The packed copies are
rebuilt automatically whenever a weight changes (tracked by tensor version counters).
The engine's fp32 CPU forward runs the same layer ops as one TorchScript function
(`specroll.model.decode`: no Python between the kernels, the eager loop's result bit for
bit).

Dtypes: the weights, activations and KV cache are in the weights' dtype (fp32, or bf16
for a bf16 engine: `weights.for_inference`); the logits are upcast to fp32, so every
sampler and the verifier see fp32. bf16 weights are prepacked too where the CPU has
native bf16 (AVX-512 BF16 / AMX).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specroll.model import decode
from specroll.model.config import ModelConfig
from specroll.model.kv_cache import KeyChain, KVCache, LayerKV
from specroll.model.ops import (
    MATRICES,
    Rotary,
    additive_mask,
    apply_rotary,
    attention,
    attention_layout,
    fold_mask,
    rms_norm,
)
from specroll.model.packed import PackedWeights
from specroll.model.packed import packed_mm as _mm

__all__ = [  # the ops and caches, importable from here as before
    "MATRICES",
    "Block",
    "KVCache",
    "KeyChain",
    "LayerKV",
    "ModelOutput",
    "Rotary",
    "Transformer",
    "additive_mask",
    "apply_rotary",
    "attention",
    "attention_layout",
    "fold_mask",
    "rms_norm",
]


@dataclass
class ModelOutput:
    logits: torch.Tensor | None
    """[B, n, V] fp32 logits at the requested positions (n = T unless `logits_index` is set);
    a bf16 model's logits are its bf16 LM-head product, upcast."""
    hidden: dict[int, torch.Tensor]
    """Residual stream after i layers ([B, T, H]) for each requested i (0 = embeddings,
    num_layers = last layer before the final norm)."""


class Block(nn.Module):
    """Pre-norm decoder layer: RMSNorm → GQA attention → RMSNorm → SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        self.cfg = cfg
        self.attn_norm = nn.Parameter(torch.ones(H))
        self.wqkv = nn.Parameter(torch.empty(H, q + 2 * kv))  # [H, q + 2kv]
        self.bqkv = nn.Parameter(torch.zeros(q + 2 * kv)) if cfg.attention_bias else None
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.wo = nn.Parameter(torch.empty(q, H))  # [q, H]
        self.mlp_norm = nn.Parameter(torch.ones(H))
        self.w_gate_up = nn.Parameter(torch.empty(H, 2 * inter))  # [H, 2I]
        self.w_down = nn.Parameter(torch.empty(inter, H))  # [I, H]
        self.lora: nn.Module | None = None
        """This layer's adapters (`model.lora.LayerLoRA`), added to its products; None
        without (or when an engine serves them merged)."""

    def _proj(self, name: str, h: torch.Tensor, pk: dict[str, torch.Tensor]) -> torch.Tensor:
        """h @ the matrix `name` (prepacked when given), plus its adapters' share."""
        y = _mm(h, getattr(self, name), pk.get(name))
        return y if self.lora is None else self.lora.add(name, h, y)

    def forward(
        self,
        x: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer_cache: LayerKV | KeyChain | None,
        cache_len: int,
        packed: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        pk = packed or {}
        B, T, _ = x.shape
        eps = cfg.rms_norm_eps
        h = rms_norm(x, self.attn_norm, eps)
        qkv = self._proj("wqkv", h, pk)  # [B, T, q + 2kv]
        if self.bqkv is not None:
            qkv = qkv + self.bqkv
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(B, T, cfg.num_heads, cfg.head_dim)
        k = k.view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(B, T, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, eps)
            k = rms_norm(k, self.k_norm, eps)
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        else:  # q and k are adjacent in qkv: one rotation of both (half the kernels)
            qk = qkv[..., : cfg.q_size + cfg.kv_size].view(B, T, -1, cfg.head_dim)
            q, k = apply_rotary(qk, *rope).split([cfg.num_heads, cfg.num_kv_heads], dim=2)
        if layer_cache is None:
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, hd]
        elif isinstance(layer_cache, KeyChain):
            keys, values = layer_cache.extend(k, v)
        else:  # each row writes its T tokens at its own positions
            keys, values = layer_cache.write(k, v, cache_len)
        o = attention(q, keys, values, mask, cfg.head_dim**-0.5)
        x = x + self._proj("wo", o, pk)
        h = rms_norm(x, self.mlp_norm, eps)
        gate, up = self._proj("w_gate_up", h, pk).chunk(2, dim=-1)
        return x + self._proj("w_down", F.silu(gate) * up, pk)


class Transformer(nn.Module):
    """Llama / Qwen2 / Qwen3 / SmolLM2 decoder-only language model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # token embedding stored [H, V]: the tied LM head is then a plain `x @ embed`
        self.embed = nn.Parameter(torch.empty(cfg.hidden_size, cfg.vocab_size))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.hidden_size, cfg.vocab_size))
        )
        self.rotary = Rotary(cfg)
        self.lora_spec = None
        """The shape of the layers' adapters (`model.lora.LoraSpec`; `lora.attach`), or
        None: a policy without adapters, or an engine serving them merged."""
        self.use_packed = True
        """Use oneDNN-prepacked weights in grad-free CPU forwards (see module docstring)."""
        self._packed = PackedWeights()

    def for_training(self) -> Transformer:
        """Forwards use the parameters themselves, never prepacked copies (which carry no
        autograd and would go stale under an optimizer): the learner's policy."""
        self.use_packed = False
        return self

    def init_weights(self, seed: int = 0, std: float = 0.02) -> Transformer:
        """Random normal init (tiny test models); norms start at one, biases at zero."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if "norm" in name:
                    p.fill_(1.0)
                else:  # matrices and biases
                    p.normal_(0.0, std, generator=g)
        return self

    def final_state(self, h: torch.Tensor) -> torch.Tensor:
        """The residual stream after the last layer [..., H] -> the normed final state
        (the policy's logits are `final_state(h) @ head_weight`; MTP heads read it)."""
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    def packed_weights(self) -> list[dict[str, torch.Tensor]] | None:
        """Per-layer prepacked matrices (+ {"head": LM head} last), or None (see
        PackedWeights; also None when `use_packed` is off)."""
        if not self.use_packed:
            return None
        mats = [getattr(b, n) for b in self.layers for n in MATRICES] + [self.head_weight]
        m = len(MATRICES)

        def arrange(p: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
            per_layer = [
                dict(zip(MATRICES, p[i : i + m], strict=True)) for i in range(0, len(p) - 1, m)
            ]
            return per_layer + [{"head": p[-1]}]

        return self._packed.get(mats, arrange)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head  # [H, V]

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, T] ids → [B, T, H] embeddings."""
        B, T = tokens.shape
        return self.embed.index_select(1, tokens.reshape(-1)).T.reshape(B, T, -1)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        logits_index: torch.Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        return_logits: bool = True,
        slot_start: int = 0,
        max_start: int | None = None,
        tree: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Run the decoder.

        tokens: [B, T] ids. positions: [B] start position of each row (engine mode, with
        `cache`); None means every row starts at 0. logits_index: [B, n] indices into T of
        the positions that need logits (the LM head is the costliest matmul at prefill).
        hidden_layers: which residual-stream states to return (see ModelOutput.hidden).
        slot_start: row b uses cache slot slot_start + b (lets the engine prefill new rows
        behind the ones already decoding). max_start: max(positions), when the caller
        knows it on the host (see `attention_layout`). tree: [B, T, T] ancestor matrix
        when the T tokens are a draft tree (engine mode; see `attention_layout`).
        """
        cfg = self.cfg
        B, T = tokens.shape
        pos, mask, cache_len, top = attention_layout(
            cfg, tokens, positions, cache, slot_start, max_start, tree
        )
        # a tree's tokens go to consecutive cache positions whatever their depth
        wpos = pos if tree is None else positions.unsqueeze(1) + torch.arange(T, device=pos.device)
        rope = self.rotary(pos, top)

        packed = self.packed_weights()
        x = self.embed_tokens(tokens)
        mask = additive_mask(mask, x.dtype)  # once, not in every layer's SDPA
        hidden: dict[int, torch.Tensor] = {}
        wanted = set(hidden_layers)
        if 0 in wanted:
            hidden[0] = x
        index = None if cache is None else cache.write_index(wpos)  # once for all layers
        if cache is not None and decode.applies(self, x, packed):
            # the same ops without Python in between: the engine's CPU forward
            x, states = decode.run(
                self, x, mask, rope, cache, index, slot_start, cache_len, packed, wanted
            )
            hidden |= states
        else:
            for i, layer in enumerate(self.layers):
                lc = None if cache is None else cache.layer(i, slot_start, index)
                x = layer(x, pos, mask, rope, lc, cache_len, packed and packed[i])
                if i + 1 in wanted:
                    hidden[i + 1] = x
        if not return_logits:
            return ModelOutput(None, hidden)
        if logits_index is not None:
            x = x.gather(1, logits_index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        return ModelOutput(self.head_logits(x, packed or []), hidden)

    def head_logits(
        self, h: torch.Tensor, packed: list[dict[str, torch.Tensor]] | None = None
    ) -> torch.Tensor:
        """Residual stream after the last layer [..., H] → fp32 logits [..., V] (the tree
        verifier calls it on the path it walks, not on every node)."""
        if packed is None:
            packed = self.packed_weights()
        head = packed[-1]["head"] if packed else None
        # logits in the weights' dtype, upcast: sampling and verification run in fp32
        return _mm(self.final_state(h), self.head_weight, head).float()
