"""EAGLE-3 draft head: the network and its checkpoint I/O (the speculative loop lives elsewhere).

EAGLE-3 (arXiv 2503.01840) drafts with one extra decoder layer that reads the target's own
features: three residual-stream states of the target (low / mid / high layers) are fused by
`fc` (3H → H) into `h`; the layer's attention reads cat(input_layernorm(embed(x_{t+1})),
hidden_norm(h_t)) (2H wide) and its residual is h_t. The *prenorm* output is fed back as the
next step's h, so the head can draft k tokens recursively. It predicts over a reduced draft
vocabulary; `d2t` maps it back (target_id = draft_id + d2t[draft_id]).

The head runs the same attention, mask, RoPE and matmul code as the target
(`specroll.model.transformer`), with its own one-layer `KVCache` (row b ↔ slot b): cache=None is
the full-sequence causal forward used in training, a cache gives the engine's incremental mode.
The token embedding is the target's, referenced (never copied) and detached: the draft loss can
never move a policy parameter. Checkpoints use the layout SpecForge exports and vLLM's
`llama_eagle3.py` loads, so heads trained elsewhere load here and ours serve in vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specroll.drafters.base import FeatureDrafter
from specroll.drafters.ttt import Unroll
from specroll.model.config import ModelConfig
from specroll.model.transformer import (
    KVCache,
    PackedWeights,
    Rotary,
    Transformer,
    _mm,
    apply_rotary,
    attention,
    attention_layout,
)

Embed = Callable[[torch.Tensor], torch.Tensor]
_MATRICES = ("fc", "wqkv", "wo", "w_gate_up", "w_down", "lm_head")


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
        return cls._from_layer(target, draft_vocab_size or target.vocab_size, (2, L // 2, L - 3))

    @classmethod
    def _from_layer(cls, layer: ModelConfig, draft_vocab_size: int, aux: Any, **kw) -> Eagle3Config:
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
            self.t2d.copy_(torch.arange(self.cfg.vocab_size) < self.cfg.draft_vocab_size)
        return self

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        """A one-layer KV cache for this head (row b of a batch ↔ slot slot_start + b)."""
        return KVCache(self.cfg.layer, num_slots, max_len, self.fc.dtype, self.fc.device)

    def _packed_weights(self) -> dict[str, torch.Tensor] | None:
        if not self.use_packed:
            return None
        mats = [getattr(self, n) for n in _MATRICES]
        return self._packed.get(mats, lambda p: dict(zip(_MATRICES, p, strict=True)))

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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits [B, T, Vd] and prenorm hidden [B, T, H] (the next step's `hidden`).

        tokens: [B, T] ids x_{t+1}; hidden: [B, T, H] fused features (or a previous prenorm
        output) for positions t. positions: [B] start position of each row (RoPE, and the
        cache slots written with `cache`). cache=None: causal over the T tokens (training);
        with a cache, key j is visible to query i iff j <= positions[b] + i, like the target.
        unroll: one step of training-time test (positions, mask and earlier steps' keys
        given by `drafters.ttt`); replaces positions and cache, and skips the read-out
        (logits None: call `readout` on the positions that are scored).
        """
        if self.embed is None:
            raise ValueError("Eagle3Head has no token embedding: call set_embedding(target)")
        cfg, c = self.cfg, self.cfg.layer
        B, T = tokens.shape
        dev = tokens.device
        if cache is not None:
            shape = (1, cache.num_slots, c.num_kv_heads, cache.max_len, c.head_dim)
            if tuple(cache.k.shape) != shape:
                raise ValueError(f"cache shape {tuple(cache.k.shape)} is not this head's")
        if unroll is not None:
            pos, mask, cache_len = unroll.pos, unroll.mask, 0
        else:
            pos, mask, cache_len = attention_layout(c, tokens, positions, cache, slot_start)
        cos, sin = self.rotary(pos)  # [B, T, 1, hd] each
        pk = self._packed_weights() or {}
        eps = cfg.rms_norm_eps

        emb = self.embed(tokens).detach()  # [B, T, H], frozen target embedding
        h_normed = F.rms_norm(hidden, (hidden.shape[-1],), self.hidden_norm, eps)
        residual = h_normed if cfg.norm_before_residual else hidden  # [B, T, H]
        e_normed = F.rms_norm(emb, (emb.shape[-1],), self.input_layernorm, eps)
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
        else:
            rows = slice(slot_start, slot_start + B)
            ck, cv = cache.k[0, rows], cache.v[0, rows]  # [B, Hkv, max_len, hd] views
            r = torch.arange(B, device=dev).unsqueeze(1).expand(B, T)
            ck[r, :, pos], cv[r, :, pos] = k, v
            keys, values = ck[:, :, :cache_len], cv[:, :, :cache_len]
        o = attention(q, keys, values, mask, c.head_dim**-0.5)  # [B, T, q]
        x = residual + _mm(o, self.wo, pk.get("wo"))  # [B, T, H]
        h = F.rms_norm(x, (x.shape[-1],), self.post_attention_layernorm, eps)
        gate, up = _mm(h, self.w_gate_up, pk.get("w_gate_up")).chunk(2, dim=-1)  # [B, T, I] x2
        prenorm = x + _mm(F.silu(gate) * up, self.w_down, pk.get("w_down"))  # [B, T, H]
        if unroll is not None:
            return None, prenorm  # training reads out only the positions it scores
        return self.readout(prenorm), prenorm  # [B, T, Vd], [B, T, H]

    def readout(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Prenorm state [..., H] → draft logits [..., Vd] (final norm + LM head)."""
        pk = self._packed_weights() or {}
        out = F.rms_norm(prenorm, (prenorm.shape[-1],), self.norm, self.cfg.rms_norm_eps)
        return _mm(out, self.lm_head, pk.get("lm_head"))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids → target ids (same shape)."""
        return draft_ids + self.d2t[draft_ids]

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., Vd] → [..., V] with -inf outside the draft vocabulary (as vLLM compute_logits)."""
        ids = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.cfg.vocab_size), -torch.inf)
        return full.index_copy(-1, ids, draft_logits)


# ---------------------------------------------------------------------- checkpoint I/O


def _hf_tensors(head: Eagle3Head) -> dict[str, torch.Tensor]:
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
    (out / "config.json").write_text(json.dumps(head.cfg.to_hf(), indent=2) + "\n")
    save_file(_hf_tensors(head), str(out / "model.safetensors"), metadata={"format": "pt"})


def _check(hf: dict[str, Any], name: str, want: Any, what: str) -> None:
    if hf.get(name, want) != want:
        raise ValueError(f"EAGLE-3 config {name}={hf.get(name)!r} but {what} needs {want!r}")


def load_eagle3(
    path: str | Path, target_cfg: ModelConfig, embed: Embed | Transformer | None = None
) -> Eagle3Head:
    """Read a head saved by `save_eagle3`, SpecForge or vLLM (`midlayer.*` or `layers.0.*`)."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    _check(hf, "hidden_size", target_cfg.hidden_size, "the target")
    _check(hf, "target_hidden_size", target_cfg.hidden_size, "the target")
    _check(hf, "vocab_size", target_cfg.vocab_size, "the target")
    _check(hf, "num_hidden_layers", 1, "this EAGLE-3 head")
    for flag in ("attention_bias", "mlp_bias"):
        _check(hf, flag, False, "this EAGLE-3 head")
    if not (hf.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        raise ValueError("eagle_config.use_aux_hidden_state=false (no fc) is not supported")
    layer = ModelConfig.from_hf({**hf, "model_type": "llama"})  # rope fields, both spellings
    L = target_cfg.num_layers
    aux = hf.get("eagle_aux_hidden_state_layer_ids") or (2, L // 2, L - 3)
    if len(aux) != 3 or not all(0 <= i <= L for i in aux):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids={aux} invalid for {L} target layers")
    cfg = Eagle3Config._from_layer(
        layer,
        hf.get("draft_vocab_size") or layer.vocab_size,
        aux,
        norm_before_residual=bool(hf.get("norm_before_residual", False)),
    )
    head = Eagle3Head(cfg, embed)  # every parameter and buffer is overwritten below
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {path} (pickled checkpoints are not read)")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(str(f)))
    got: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        name = name.removeprefix("model.")
        if name.startswith("layers.0."):  # vLLM's module name; it maps midlayer. onto it
            name = "midlayer." + name.removeprefix("layers.0.")
        if name != "embed_tokens.weight":  # the target's embedding is used instead
            got[name] = t
    want = {n: t.shape for n, t in _hf_tensors(head).items()}
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


# ---------------------------------------------------------------------- drafter


class Eagle3Drafter(FeatureDrafter):
    """EAGLE-3 in the engine: pairs (fused target feature h_t, token x_{t+1}) → x_{t+2};
    recursive drafting feeds back the head's prenorm hidden state."""

    name = "eagle3"

    def __init__(self, head: Eagle3Head, version: int = 0) -> None:
        super().__init__(version)
        self.head = head.eval()
        self.hidden_layers = tuple(head.cfg.aux_layers)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return self.head.new_cache(num_slots, max_len)

    def features(self, hidden: dict[int, torch.Tensor], width: int) -> torch.Tensor:
        return self.head.fuse([hidden[i][:, :width] for i in self.hidden_layers])

    def run(self, depth, tokens, feats, positions, slot_start=0):
        return self.head(
            tokens, feats, positions=positions, cache=self.cache, slot_start=slot_start
        )

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_logits(logits)
