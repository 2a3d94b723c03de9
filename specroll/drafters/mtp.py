"""MTP in the engine: the proposer that drafts with MTP heads (the network and its training:
`drafting.mtp_heads`)."""

from __future__ import annotations

import torch

from specroll.drafters.feature import FeatureDrafter
from specroll.model.kv_cache import KVCache


class MTPDrafter(FeatureDrafter):
    """MTP heads in the engine: pairs (target's normed last hidden state h_t, x_{t+1}) →
    x_{t+2} through head 0, then recursively through heads 1, 2, ... (cycling).

    Committed pairs are fed to head 0 from the target's states after every verification.
    Heads >= 1 see only the recursive states of the current proposal (their caches are
    not back-filled along committed positions); with the default single head this is the
    complete DeepSeek-V3 scheme.
    """

    name = "mtp"

    def __init__(self, draft, version: int = 0) -> None:
        super().__init__(version)
        self.draft = self.network = draft.eval()
        self.hidden_layers = (draft.target.cfg.num_layers,)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return self.draft.new_cache(num_slots, max_len)

    def features(self, hidden: dict[int, torch.Tensor], width: int) -> torch.Tensor:
        h = hidden[self.hidden_layers[0]][:, :width]  # [n, width, H] before the final norm
        return self.draft.target.final_state(h)

    def run(self, depth, tokens, feats, positions, slot_start=0, logits_index=None, max_start=None):
        return self.draft(
            depth,
            tokens,
            feats,
            positions=positions,
            cache=self.cache,
            slot_start=slot_start,
            logits_index=logits_index,
            max_start=max_start,
        )
