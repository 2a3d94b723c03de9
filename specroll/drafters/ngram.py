"""N-gram / prompt-lookup drafter: copy what followed the latest earlier occurrence of the
row's current suffix. Model-free, deterministic (one-hot q), strong on repetitive text
such as math derivations that restate the prompt.

Vectorised over rows: for n from n_max down to n_min, every row's last n tokens are
compared with all windows of its history at once; the longest n with a match wins and
the most recent match is used.
"""

from __future__ import annotations

import torch

from specroll.drafters.base import DraftBatch, Drafter, Proposal


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, n_max: int = 3, n_min: int = 1) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_max, self.n_min = n_max, n_min

    in_step = True  # (it keeps no tensors: its epoch stays 0)

    def propose(self, batch: DraftBatch) -> Proposal:
        """The rows' histories searched as far as the deepest row's position (inside a
        captured step: `keys` wide; past a row's length nothing matches, and a padding
        row, at position 0, matches nothing)."""
        if batch.keys is not None:
            return self._match(batch, batch.keys)
        L = int(batch.pos.max()) + 1 if batch.max_pos is None else batch.max_pos + 1
        return self._match(batch, L)

    def _match(self, batch: DraftBatch, L: int) -> Proposal:
        """The continuation of each row's longest recent n-gram match within the first L
        positions of its history."""
        B, k = batch.last.shape[0], batch.k
        length = batch.pos + 1  # [B] valid history per row (last token included)
        hist = batch.history[:B, :L]  # [B, L]
        long = dict(dtype=torch.long, device=hist.device)
        found = torch.full((B,), -1, **long)  # start of the continuation
        idx = torch.arange(L, **long)
        for n in range(self.n_max, self.n_min - 1, -1):
            if n >= L:
                continue
            suffix_at = (length - n).clamp(min=0)  # [B]
            suffix = hist.gather(1, suffix_at.unsqueeze(1) + idx[:n])  # [B, n]
            windows = hist.unfold(1, n, 1)  # [B, L-n+1, n]
            match = (windows == suffix.unsqueeze(1)).all(dim=-1)  # [B, L-n+1]
            # a match must end before the suffix itself starts... and leave a next token
            starts = idx[: L - n + 1]
            match &= (starts + n < length.unsqueeze(1)) & (starts < suffix_at.unsqueeze(1))
            match &= (length > n).unsqueeze(1)
            latest = torch.where(match, starts, torch.full_like(starts, -1)).max(dim=1).values
            take = (found < 0) & (latest >= 0)
            found = torch.where(take, latest + n, found)
        # continuation tokens, cut where the history ends; rows without a match draft none
        cont = found.clamp(min=0).unsqueeze(1) + torch.arange(k, **long)  # [B, k]
        ok = (found >= 0).unsqueeze(1) & (cont < length.unsqueeze(1))
        tokens = hist.gather(1, cont.clamp(max=L - 1))
        return Proposal(tokens=tokens, probs=None, lengths=ok.sum(dim=1))
