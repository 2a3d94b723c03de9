"""Multi-token-prediction (MTP) draft heads in the DeepSeek-V3 / Qwen3-Next form.

Head i reads the target's state h_t and the next token x_{t+1} at position t and predicts
x_{t+2}:

    e = enorm(embed(x_{t+1}))     g = hnorm(h_t)     z = eh_proj(cat(e, g))   (2H → H)
    y = Block(z)                  one target-shaped decoder layer with its own KV cache
    logits = norm(y) @ head       the target's LM head (and, for fresh heads, its final norm)

Models pretrained with MTP modules ship such a drafter for free; for the others a fresh
head whose layer starts as a copy of the target's last layer is a cheap, good drafter.
Used recursively (more draft tokens than heads), depth d runs head d % num_heads and the
state it returns is fed back as h.

The embedding, LM head (and shared final norm) are the target's, read through detached
views: a draft loss can never move a policy parameter. The decoder layer reuses
`specroll.model.transformer.Block`, so both call patterns of the target exist here too:
full-sequence causal (training, `cache=None`) and incremental per-slot (engine).

Native checkpoints (naming checked against vLLM `deepseek_mtp.py` / `qwen3_next_mtp.py`
and transformers 5.x `MtpModel`): Qwen3-Next `mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden,
fc, norm}` (one set for all layers) + `mtp.layers.{i}.*`; DeepSeek-V3
`model.layers.{L+i}.{enorm, hnorm, eh_proj, shared_head.norm}` + the layer tensors under
the same prefix (`embed_tokens` / `shared_head.head` there are copies of the target's and
are skipped). Both have a per-module final norm. Qwen3-Next norms are Gemma-style
`x * (1 + w)`: `norm_offset` adds the 1. This file is the network; its weight I/O is
`specroll.drafting.mtp_io`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

from specroll.drafters.mtp import MTPDrafter
from specroll.drafting.ttt import Unroll
from specroll.model.config import ModelConfig, check_draft_size
from specroll.model.kv_cache import KVCache, LayerKV
from specroll.model.ops import Rotary, attention_layout, rms_norm
from specroll.model.packed import packed_mm as _mm
from specroll.model.transformer import Block, Transformer

MATRICES = ("eh_proj", "wqkv", "wo", "w_gate_up", "w_down")  # stored [in, out]; HF [out, in]


@dataclass
class MTPConfig:
    """How many MTP heads a draft has and the shape of the decoder layer in each."""

    num_heads_mtp: int = 1
    """Number of MTP modules; draft depth d uses head d % num_heads_mtp."""
    layer: ModelConfig = field(default_factory=ModelConfig)
    """The target's shape, copied into each head's layer (num_layers = num_heads_mtp)."""
    own_final_norm: bool = False
    """Each head has its own final norm (native checkpoints); False = the target's norm."""
    feed_back_normed: bool = False
    """Returned state is after the final norm (Qwen3-Next in vLLM); False = before it."""

    def __post_init__(self) -> None:
        if isinstance(self.layer, dict):
            self.layer = ModelConfig(**self.layer)
        if self.num_heads_mtp < 1:
            raise ValueError(f"num_heads_mtp must be >= 1, got {self.num_heads_mtp}")
        if self.layer.num_layers != self.num_heads_mtp:
            raise ValueError(
                f"layer.num_layers={self.layer.num_layers} must equal "
                f"num_heads_mtp={self.num_heads_mtp} (one KV-cache layer per head)"
            )

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, num_mtp: int = 1, **kw: bool) -> MTPConfig:
        """Heads whose decoder layer has the target's shape."""
        return cls(num_mtp, replace(target_cfg, num_layers=num_mtp), **kw)

    def to_dict(self) -> dict:
        return asdict(self)


class MTPHead(nn.Module):
    """One MTP module: fuse (embedding, target state), one decoder layer, norm + LM head."""

    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        H = cfg.layer.hidden_size
        self.eps = cfg.layer.rms_norm_eps
        self.feed_back_normed = cfg.feed_back_normed
        self.enorm = nn.Parameter(torch.ones(H))
        self.hnorm = nn.Parameter(torch.ones(H))
        self.eh_proj = nn.Parameter(torch.empty(2 * H, H))  # [2H, H], input-major, no bias
        self.block = Block(cfg.layer)
        self.final_norm = nn.Parameter(torch.ones(H)) if cfg.own_final_norm else None

    def forward(
        self,
        emb: torch.Tensor,
        hidden: torch.Tensor,
        pos: torch.Tensor,
        mask: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        layer_cache: LayerKV | None,
        cache_len: int,
        shared_norm: torch.Tensor,
        head: torch.Tensor,
        head_packed: torch.Tensor | None = None,
        logits_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """emb, hidden: [B, T, H] → (logits [B, n, V], state [B, T, H]); see MTPDraft."""
        H = emb.shape[-1]
        e = rms_norm(emb, self.enorm, self.eps)
        g = rms_norm(hidden, self.hnorm, self.eps)
        z = torch.cat([e, g], dim=-1) @ self.eh_proj  # [B, T, H] (embedding first)
        y = self.block(z, pos, mask, rope, layer_cache, cache_len)  # [B, T, H]
        w = shared_norm if self.final_norm is None else self.final_norm
        yn = rms_norm(y, w, self.eps)
        out = (
            yn if logits_index is None else yn.gather(1, logits_index[..., None].expand(-1, -1, H))
        )
        return _mm(out, head, head_packed), (yn if self.feed_back_normed else y)


class MTPDraft(nn.Module):
    """MTP heads on top of a target whose embedding, LM head and final norm they share.

    The target is held by reference, not as a submodule: it is not in `parameters()`,
    `state_dict()` or `.to()`, and the draft only ever sees detached views of it.
    """

    def __init__(self, cfg: MTPConfig, target: Transformer) -> None:
        super().__init__()
        for name in ("hidden_size", "vocab_size"):
            if (a := getattr(cfg.layer, name)) != (b := getattr(target.cfg, name)):
                raise ValueError(f"MTP {name}={a} differs from the target's {b}")
        check_draft_size(cfg.layer, target.cfg, "the MTP config")
        self.cfg = cfg
        self.heads = nn.ModuleList(MTPHead(cfg) for _ in range(cfg.num_heads_mtp))
        self.rotary = Rotary(cfg.layer)
        object.__setattr__(self, "target", target)  # bypass submodule registration

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def new_cache(
        self,
        num_slots: int,
        max_len: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A KV cache with one layer per head (row b ↔ slot b, like the target's)."""
        p = self.heads[0].eh_proj
        return KVCache(self.cfg.layer, num_slots, max_len, dtype or p.dtype, device or p.device)

    def init_weights(
        self, seed: int = 0, std: float = 0.02, from_last_layer: bool = False
    ) -> MTPDraft:
        """Fresh heads: matrices (and biases) normal(0, std), norms one, like the target;
        with `from_last_layer` each head's decoder layer starts as the target's last one."""
        g = torch.Generator().manual_seed(seed)
        last = dict(self.target.layers[-1].named_parameters())
        with torch.no_grad():
            for name, p in self.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if from_last_layer and ".block." in name:
                    if last[leaf].shape != p.shape:
                        raise ValueError(f"{name} {tuple(p.shape)} != target's last layer")
                    p.copy_(last[leaf])
                elif "norm" in leaf:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=g)
        return self

    def forward(
        self,
        i: int,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slot_start: int = 0,
        logits_index: torch.Tensor | None = None,
        unroll: Unroll | None = None,
        max_start: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run head i % num_heads.

        tokens: [B, T] ids x_{t+1}; hidden: [B, T, H] the state h_t at the same positions
        (for native heads the target's last layer after its final norm, as vLLM and
        transformers feed it; at depth > 0 the state this method returned). positions:
        [B] start position of each row (engine mode, with `cache`; None = all start at 0).
        Key j is visible to query t of row b iff j <= positions[b] + t; row b uses cache
        slot slot_start + b. logits_index: [B, n] indices into T that need logits.
        unroll: a training-time-test step (drafting.ttt) instead of positions / cache.
        max_start: max(positions) when the caller knows it on the host (no read-back).
        Returns (logits [B, n, V] with n = T unless logits_index, state [B, T, H]).
        """
        lc_cfg = self.cfg.layer
        B, T = tokens.shape
        j = i % self.num_heads
        if cache is not None and cache.k.shape[0] != self.num_heads:
            raise ValueError(f"cache has {cache.k.shape[0]} layers, need {self.num_heads}")
        pos, mask, cache_len, top = attention_layout(
            lc_cfg, tokens, positions, cache, slot_start, max_start
        )
        layer_cache = None
        if unroll is not None:  # training-time test step (see drafting.ttt)
            pos, mask, layer_cache, top = unroll.pos, unroll.mask, unroll.chain, unroll.top
        elif cache is not None:
            layer_cache = cache.layer(j, slot_start, cache.write_index(pos))
        t = self.target
        packed = t.packed_weights()  # the LM head prepacked for grad-free CPU forwards
        return self.heads[j](
            t.embed_tokens(tokens).detach(),
            hidden,
            pos,
            mask,
            self.rotary(pos, top),
            layer_cache,
            cache_len,
            t.norm.detach(),
            t.head_weight.detach(),
            packed[-1]["head"] if packed else None,
            logits_index,
        )

    def readout(self, state: torch.Tensor, i: int = 0) -> torch.Tensor:
        """State [..., H] returned by head i → logits [..., V] (what forward computes)."""
        head = self.heads[i % self.num_heads]
        t = self.target
        if not head.feed_back_normed:
            w = t.norm.detach() if head.final_norm is None else head.final_norm
            state = rms_norm(state, w, head.eps)
        return state @ t.head_weight.detach()

    # ------------------------------------------- TrainableDraft (specroll.drafting.trainable)
    # (training drives head 0, recursively: the single-head scheme that is trained here)

    kind = "mtp"

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return ()

    @property
    def reads_final(self) -> bool:
        return True

    @property
    def vocab(self) -> None:
        return None  # the target's own vocabulary and LM head

    @property
    def kv_group(self) -> int:
        return self.cfg.layer.num_heads // self.cfg.layer.num_kv_heads

    def features(self, aux: torch.Tensor, final: torch.Tensor | None) -> torch.Tensor:
        """The policy's normed last state is head 0's input (`aux` is not read)."""
        if final is None:
            raise ValueError("MTP heads read the policy's final state: pass `final`")
        return final

    def step(self, tokens: torch.Tensor, states: torch.Tensor, unroll: Unroll):
        return self(0, tokens, states, unroll=unroll)

    def drafter(self, version: int = 0) -> MTPDrafter:
        return MTPDrafter(self, version)

    def for_training(self) -> MTPDraft:
        """Nothing to do: MTP's own forwards never use prepacked weights."""
        return self
