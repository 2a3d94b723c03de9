"""EAGLE-3 in the engine: the proposer that drafts with an EAGLE-3 head (the network and its
training: `drafting.eagle3_head`)."""

from __future__ import annotations

import torch

from specroll.drafters.base import RowState
from specroll.drafters.feature import FeatureDrafter
from specroll.model.kv_cache import KVCache


class Eagle3Drafter(FeatureDrafter):
    """EAGLE-3 in the engine: pairs (fused target feature h_t, token x_{t+1}) → x_{t+2};
    recursive drafting feeds back the head's prenorm hidden state.

    The fusion (`fc`, 3H → H) runs when pairs are fed, not when they are committed: the
    three target states are kept as they are, and a row that never drafts (the
    large-batch head of a rollout) costs a copy, not a matmul per token — about 1 % of
    a target forward at SmolLM2's width. Keeping 3H per pair instead of H triples the
    buffer; past `lazy_bytes` the drafter fuses at commit as before."""

    name = "eagle3"
    lazy_bytes = 1 << 30
    """Largest buffer of unfused states [slots, cache length, 3H] kept per generate call."""

    def __init__(self, head, version: int = 0) -> None:
        super().__init__(version)
        self.head = self.network = head.eval()
        self.hidden_layers = tuple(head.cfg.aux_layers)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return self.head.new_cache(num_slots, max_len)

    def start(self, num_slots: int, max_len: int, rows: RowState | None = None) -> None:
        super().start(num_slots, max_len, rows)
        c = self.cache
        kept = c.num_slots * c.max_len * 3 * self.head.cfg.hidden_size * c.k.element_size()
        self.lazy = kept <= self.lazy_bytes

    def features(self, hidden: dict[int, torch.Tensor], width: int) -> torch.Tensor:
        aux = [hidden[i][:, :width] for i in self.hidden_layers]  # 3 x [n, width, H]
        return torch.cat(aux, dim=-1) if self.lazy else self.head.fuse(aux)

    def condition(self, kept: torch.Tensor) -> torch.Tensor:
        if not self.lazy:
            return kept
        return self.head.fuse(list(kept.split(self.head.cfg.hidden_size, dim=-1)))

    def run(self, depth, tokens, feats, positions, slot_start=0, logits_index=None, max_start=None):
        return self.head(
            tokens,
            feats,
            positions=positions,
            cache=self.cache,
            slot_start=slot_start,
            logits_index=logits_index,
            max_start=max_start,
        )

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_logits(logits)

    @torch.no_grad()
    def warm(self) -> None:
        self.head._packed_weights()
