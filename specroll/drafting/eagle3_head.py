"""EAGLE-3 draft head: the network (checkpoint I/O: `eagle3_io`; the loop: `base`).

EAGLE-3 (arXiv 2503.01840) drafts with one extra decoder layer that reads the target's own
features: three residual-stream states of the target (low / mid / high layers) are fused by
`fc` (3H → H) into `h`; the layer's attention reads cat(input_layernorm(embed(x_{t+1})),
hidden_norm(h_t)) (2H wide) and its residual is h_t. The *prenorm* output is fed back as the
next step's h, so the head can draft k tokens recursively. It predicts over a reduced draft
vocabulary; `d2t` maps it back (target_id = draft_id + d2t[draft_id]).

The head runs the same attention, mask, RoPE and matmul code as the target
(`specroll.model.ops`), with its own one-layer `KVCache` (row b ↔ slot b): cache=None is
the full-sequence causal forward used in training, a cache gives the engine's incremental mode.
The token embedding is the target's, referenced (never copied) and detached: the draft loss can
never move a policy parameter. Checkpoints use the layout SpecForge exports and vLLM's
`llama_eagle3.py` loads, so heads trained elsewhere load here and ours serve in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specroll.drafters.eagle3 import Eagle3Drafter
from specroll.drafting.ttt import Unroll
from specroll.model.config import ModelConfig
from specroll.model.kv_cache import KVCache
from specroll.model.ops import Rotary, apply_rotary, attention, attention_layout, rms_norm
from specroll.model.packed import PackedWeights
from specroll.model.packed import packed_mm as _mm
from specroll.model.transformer import Transformer

Embed = Callable[[torch.Tensor], torch.Tensor]
MATRICES = ("fc", "wqkv", "wo", "w_gate_up", "w_down", "lm_head")
"""The head's weight matrices, stored [in, out] (the checkpoint stores [out, in])."""


@dataclass
class Eagle3Config:
    """Shape of an EAGLE-3 head (one Llama decoder layer) and which target features it reads."""

    hidden_size: int
    """Width H; must equal the target's (the head reads the target's embedding)."""
    intermediate_size: int
    """SwiGLU inner width of the draft layer."""
    num_heads: int
    """Query heads of the draft layer."""
    num_kv_heads: int
    """Key/value heads of the draft layer."""
    head_dim: int
    """Per-head width; 0 means hidden_size // num_heads."""
    vocab_size: int
    """Target vocabulary V (d2t maps into it; t2d has V entries)."""
    draft_vocab_size: int
    """Draft vocabulary (lm_head rows), <= vocab_size."""
    aux_layers: tuple[int, int, int]
    """Target residual states fused by fc, in specroll's `hidden` numbering (after i layers)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: dict[str, Any] | None = None
    """RoPE scaling parameters (ModelConfig spelling), None for plain RoPE."""
    max_position_embeddings: int = 2048
    """Context window in tokens."""
    norm_before_residual: bool = False
    """vLLM option: the residual is hidden_norm(h) instead of h (SpecForge default: False)."""
    layer: ModelConfig = field(init=False, repr=False, compare=False)
    """The draft layer as a one-layer ModelConfig (for Rotary and KVCache)."""

    def __post_init__(self) -> None:
        self.aux_layers = tuple(int(i) for i in self.aux_layers)  # type: ignore[assignment]
        if len(self.aux_layers) != 3 or min(self.aux_layers) < 0:
            raise ValueError(f"aux_layers must be 3 indices >= 0, got {self.aux_layers}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size} must be in 1..vocab_size="
                f"{self.vocab_size}"
            )
        self.rope_scaling = dict(self.rope_scaling) if self.rope_scaling else None
        self.layer = ModelConfig(num_layers=1, **_shared(self))  # validates heads, head_dim, rope
        self.head_dim, self.rope_scaling = self.layer.head_dim, self.layer.rope_scaling

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int | None = None) -> Eagle3Config:
        """A head shaped like one target layer, reading the vLLM / SpecForge default features.

        vLLM (`LlamaForCausalLM.get_eagle3_aux_hidden_state_layers`) returns
        (2, L//2, L-3) and `LlamaModel.forward` appends `hidden_states + residual` *before*
        calling layer idx: the input of layer idx = the residual stream after idx layers.
        SpecForge (`Eagle3TargetModel.set_aux_hidden_states_layers`) hooks the *output* of
        layers [1, L//2-1, L-4], which is the same set. specroll's `hidden[i]` is the stream
        after i layers (0 = embeddings), so the indices are vLLM's unchanged: (2, L//2, L-3).
        vLLM reads overrides from config.json `eagle_aux_hidden_state_layer_ids` in this same
        numbering (DFlash's output-of-layer ids get +1 there).
        """
        L = target.num_layers
        if L < 3:
            raise ValueError(f"EAGLE-3 default aux layers need num_layers >= 3, got {L}")
        return cls.from_layer(target, draft_vocab_size or target.vocab_size, (2, L // 2, L - 3))

    @classmethod
    def from_layer(cls, layer: ModelConfig, draft_vocab_size: int, aux: Any, **kw) -> Eagle3Config:
        """A head whose decoder layer has the shape of `layer`, reading target layers `aux`."""
        return cls(**_shared(layer), draft_vocab_size=draft_vocab_size, aux_layers=tuple(aux), **kw)

    def to_hf(self) -> dict[str, Any]:
        """config.json as SpecForge writes it and vLLM's Eagle3LlamaForCausalLM reads it."""
        out = self.layer.to_hf()
        for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
            out.pop(k, None)
        out.update(
            architectures=["LlamaForCausalLMEagle3"],
            num_hidden_layers=1,
            draft_vocab_size=self.draft_vocab_size,
            eagle_aux_hidden_state_layer_ids=list(self.aux_layers),
            norm_before_residual=self.norm_before_residual,
            tie_word_embeddings=False,
        )
        return out


def _shared(src: Eagle3Config | ModelConfig) -> dict[str, Any]:
    """The draft-layer fields that Eagle3Config and ModelConfig spell alike (shapes, RoPE)."""
    names = set(ModelConfig.__dataclass_fields__) & set(Eagle3Config.__dataclass_fields__)
    return {n: getattr(src, n) for n in names}


class Eagle3Head(nn.Module):
    """fc → one EAGLE-3 decoder layer → norm → lm_head over the draft vocabulary.

    Weights are input-major (`x @ w`) like the target's; `wqkv` is [2H, q + 2kv].
    """

    def __init__(self, cfg: Eagle3Config, embed: Embed | Transformer | None = None) -> None:
        super().__init__()
        H, inter, c = cfg.hidden_size, cfg.intermediate_size, cfg.layer
        self.cfg = cfg
        self.fc = nn.Parameter(torch.empty(3 * H, H))  # [3H, H]
        self.hidden_norm = nn.Parameter(torch.ones(H))
        self.input_layernorm = nn.Parameter(torch.ones(H))
        self.wqkv = nn.Parameter(torch.empty(2 * H, c.q_size + 2 * c.kv_size))  # [2H, q+2kv]
        self.wo = nn.Parameter(torch.empty(c.q_size, H))  # [q, H]
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.w_gate_up = nn.Parameter(torch.empty(H, 2 * inter))  # [H, 2I]
        self.w_down = nn.Parameter(torch.empty(inter, H))  # [I, H]
        self.norm = nn.Parameter(torch.ones(H))
        self.lm_head = nn.Parameter(torch.empty(H, cfg.draft_vocab_size))  # [H, Vd]
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size)
        self.rotary = Rotary(c)
        self.embed: Embed | None = None
        self.use_packed = True
        """Use oneDNN-prepacked weights in grad-free CPU forwards (like the target)."""
        self._packed = PackedWeights()
        if embed is not None:
            self.set_embedding(embed)

    def set_embedding(self, embed: Embed | Transformer) -> Eagle3Head:
        """Reference the target's token embedding ([B, T] ids → [B, T, H]); not copied."""
        self.embed = embed.embed_tokens if isinstance(embed, Transformer) else embed
        return self

    def for_training(self) -> Eagle3Head:
        """Forwards use the parameters, never prepacked copies (`Transformer.for_training`)."""
        self.use_packed = False
        return self

    def init_weights(self, seed: int = 0, std: float = 0.02) -> Eagle3Head:
        """Random normal init; norms at one; d2t = identity over the first draft_vocab ids."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=g)
            self.d2t.zero_()
            ids = torch.arange(self.cfg.vocab_size, device=self.t2d.device)
            self.t2d.copy_(ids < self.cfg.draft_vocab_size)
        return self

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """A one-layer KV cache for this head (row b of a batch ↔ slot slot_start + b)."""
        return KVCache(self.cfg.layer, num_slots, max_len, self.fc.dtype, self.fc.device)

    def _packed_weights(self) -> dict[str, torch.Tensor] | None:
        if not self.use_packed:
            return None
        mats = [getattr(self, n) for n in MATRICES]
        return self._packed.get(mats, lambda p: dict(zip(MATRICES, p, strict=True)))

    def fuse(self, aux: Sequence[torch.Tensor]) -> torch.Tensor:
        """Three target states [B, T, H] (in aux_layers order) → fused feature [B, T, H]."""
        pk = self._packed_weights() or {}
        return _mm(torch.cat(list(aux), dim=-1), self.fc, pk.get("fc"))  # [B, T, 3H] @ [3H, H]

    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slot_start: int = 0,
        unroll: Unroll | None = None,
        logits_index: torch.Tensor | None = None,
        max_start: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits [B, n, Vd] (n = T unless `logits_index`) and prenorm hidden
        [B, T, H] (the next step's `hidden`).

        tokens: [B, T] ids x_{t+1}; hidden: [B, T, H] fused features (or a previous prenorm
        output) for positions t. positions: [B] start position of each row (RoPE, and the
        cache slots written with `cache`). cache=None: causal over the T tokens (training);
        with a cache, key j is visible to query i iff j <= positions[b] + i, like the target.
        unroll: one step of training-time test (positions, mask and earlier steps' keys
        given by `drafting.ttt`); replaces positions and cache, and skips the read-out
        (logits None: call `readout` on the positions that are scored). logits_index:
        [B, n] indices into T that need logits (catching up on many committed pairs needs
        only the last one's: the read-out over the draft vocabulary is most of the cost).
        max_start: max(positions) when the caller knows it on the host (no read-back).
        """
        if self.embed is None:
            raise ValueError("Eagle3Head has no token embedding: call set_embedding(target)")
        cfg, c = self.cfg, self.cfg.layer
        B, T = tokens.shape
        if cache is not None:
            shape = (1, cache.num_slots, c.num_kv_heads, cache.max_len, c.head_dim)
            if tuple(cache.k.shape) != shape:
                raise ValueError(f"cache shape {tuple(cache.k.shape)} is not this head's")
        if unroll is not None:
            pos, mask, cache_len, top = unroll.pos, unroll.mask, 0, unroll.top
        else:
            pos, mask, cache_len, top = attention_layout(
                c, tokens, positions, cache, slot_start, max_start
            )
        cos, sin = self.rotary(pos, top)  # [B, T, 1, hd] each
        pk = self._packed_weights() or {}
        eps = cfg.rms_norm_eps

        emb = self.embed(tokens).detach()  # [B, T, H], frozen target embedding
        h_normed = rms_norm(hidden, self.hidden_norm, eps)
        residual = h_normed if cfg.norm_before_residual else hidden  # [B, T, H]
        e_normed = rms_norm(emb, self.input_layernorm, eps)
        x = torch.cat([e_normed, h_normed], dim=-1)  # [B, T, 2H]: embedding first
        qkv = _mm(x, self.wqkv, pk.get("wqkv"))  # [B, T, q + 2kv]
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rotary(q.view(B, T, c.num_heads, c.head_dim), cos, sin)
        k = apply_rotary(k.view(B, T, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.view(B, T, c.num_kv_heads, c.head_dim)
        if unroll is not None:
            keys, values = unroll.chain.extend(k, v)
        elif cache is None:
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, T, hd]
        else:  # each row writes its T tokens at its own positions
            layer = cache.layer(0, slot_start, cache.write_index(pos))
            keys, values = layer.write(k, v, cache_len)
        o = attention(q, keys, values, mask, c.head_dim**-0.5)  # [B, T, q]
        x = residual + _mm(o, self.wo, pk.get("wo"))  # [B, T, H]
        h = rms_norm(x, self.post_attention_layernorm, eps)
        gate, up = _mm(h, self.w_gate_up, pk.get("w_gate_up")).chunk(2, dim=-1)  # [B, T, I] x2
        prenorm = x + _mm(F.silu(gate) * up, self.w_down, pk.get("w_down"))  # [B, T, H]
        if unroll is not None:
            return None, prenorm  # training reads out only the positions it scores
        if logits_index is None:
            return self.readout(prenorm), prenorm  # [B, T, Vd], [B, T, H]
        idx = logits_index.unsqueeze(-1).expand(-1, -1, prenorm.shape[-1])  # [B, n, H]
        return self.readout(prenorm.gather(1, idx)), prenorm  # [B, n, Vd], [B, T, H]

    def readout(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Prenorm state [..., H] → draft logits [..., Vd] (final norm + LM head)."""
        pk = self._packed_weights() or {}
        out = rms_norm(prenorm, self.norm, self.cfg.rms_norm_eps)
        return _mm(out, self.lm_head, pk.get("lm_head"))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids → target ids (same shape)."""
        return draft_ids + self.d2t[draft_ids]

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., Vd] → [..., V] with -inf outside the draft vocabulary (as vLLM compute_logits)."""
        ids = self.vocab
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.cfg.vocab_size), -torch.inf)
        return full.index_copy(-1, ids, draft_logits)

    # ------------------------------------------- TrainableDraft (specroll.drafting.trainable)

    kind = "eagle3"

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.cfg.aux_layers)

    @property
    def reads_final(self) -> bool:
        return False

    @property
    def vocab(self) -> torch.Tensor:
        """[Vd] target ids of the draft vocabulary (ascending)."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    @property
    def kv_group(self) -> int:
        return self.cfg.layer.num_heads // self.cfg.layer.num_kv_heads

    def features(self, aux: torch.Tensor, final: torch.Tensor | None) -> torch.Tensor:
        """aux [B, T, 3H] -> fused [B, T, H] (`final` is not read)."""
        return self.fuse(list(aux.split(self.cfg.hidden_size, dim=-1)))

    def step(self, tokens: torch.Tensor, states: torch.Tensor, unroll: Unroll):
        return self(tokens, states, unroll=unroll)

    def drafter(self, version: int = 0) -> Eagle3Drafter:
        return Eagle3Drafter(self, version)
