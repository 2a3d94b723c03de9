"""Draft-model drafter: a smaller specroll model sharing the policy's tokenizer.

It keeps its own KV cache (row b ↔ slot b, like the target's) and samples its tokens
from the processed distribution q at the request's own temperature / top-k / top-p —
the exact q handed to the verifier — which accepts more than argmax drafting at T > 0
while staying lossless. Greedy requests draft greedily.

Its cache trails the target: after a verification the accepted prefix of its own drafts
is already cached, and the tokens it never saw (the target's recovered/bonus token, or
the last draft when all were accepted) are fed at the start of the next proposal.
"""

from __future__ import annotations

import torch

from specroll.device import upload
from specroll.drafters.base import DraftBatch, Drafter, Proposal, RowState
from specroll.model.kv_cache import KVCache
from specroll.model.transformer import Transformer
from specroll.spec import rng
from specroll.spec.sampling import probs_from_logits, sample_from_probs

FEED = 2
"""Tokens a captured step feeds the draft per row before drafting: after a proposal the
draft holds all but the target's last one or two (the bonus token, and the last draft
when all were accepted); a longer lag (speculation was off) is fed eagerly first."""


class DraftModelDrafter(Drafter):
    name = "draft_model"
    in_step = True
    """Proposes on the device alone: inside the engine's step."""

    def __init__(self, model: Transformer, version: int = 0) -> None:
        self.model = self.network = model.eval()
        self.version = version
        self.cache: KVCache | None = None
        self.device = next(model.parameters()).device
        # [S] tokens in the draft's cache (`rows.draft_pos` on the host: no read sizes a
        # catch-up)
        self.dpos = torch.zeros(0, dtype=torch.long, device=self.device)
        self._k: int | None = None  # this iteration's depth, when it proposed

    def start(self, num_slots: int, max_len: int, rows: RowState | None = None) -> None:
        super().start(num_slots, max_len, rows)
        self._k = None
        c = self.cache
        p = next(self.model.parameters())
        self.device = p.device  # the model may have been moved since construction
        fits = c is not None and c.num_slots >= num_slots and c.max_len >= max_len
        if fits and c.k.device == p.device and c.k.dtype == p.dtype:
            self.dpos.zero_()  # the same tensors (graphs hold their addresses)
            return
        self.epoch += 1
        self.cache = None
        self.cache = KVCache(self.model.cfg, num_slots, max_len, p.dtype, p.device)
        self.dpos = torch.zeros(self.cache.num_slots, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def prefill(self, start: int, seqs: list[list[int]], hidden) -> None:
        prompts = [q[:-1] for q in seqs]  # the first generated token is `last`, not cached
        width = max(len(p) for p in prompts)
        long = dict(dtype=torch.long, device=self.device)
        tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts], **long)
        zeros = torch.zeros(len(prompts), **long)
        self.model(tokens, positions=zeros, cache=self.cache, slot_start=start, return_logits=False)
        lengths = [len(p) for p in prompts]
        self.dpos[start : start + len(prompts)] = upload(lengths, self.device)
        self.rows.draft_pos[start : start + len(prompts)] = lengths

    def prepare(self, B: int, k: int, history: torch.Tensor, captured: bool) -> None:
        """Before a step that proposes k drafts: captured, rows whose draft cache lags
        more than `FEED` tokens behind (speculation was off) are fed all but their last
        token eagerly."""
        self._k = k
        if not captured:
            return
        pos_host, dpos_host = self.rows.pos[:B], self.rows.draft_pos[:B]
        lag = [p + 1 - d for p, d in zip(pos_host, dpos_host, strict=True)]
        if max(lag, default=0) <= FEED:
            return
        dpos = self.dpos[:B]
        idx = (dpos.unsqueeze(1) + torch.arange(max(lag) - 1, device=self.device)).clamp(
            max=history.shape[1] - 1
        )
        self.model(
            history[:B].gather(1, idx),
            positions=dpos,
            cache=self.cache,
            return_logits=False,
            max_start=max(dpos_host),
        )  # (a row fed past its own lag writes junk its next forward overwrites)
        self.dpos[:B] = upload(pos_host, self.device)
        self.rows.draft_pos[:B] = list(pos_host)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        """Each row's history[dpos .. pos] fed (1 token, or 2 after a full acceptance,
        ...), then its k drafts. Eager, the feed is as wide as the longest lag; inside a
        captured step (`batch.keys`) every shape is fixed: `FEED` tokens fed per row
        (padding rows at position 0 of their free slot), attention's key axis `keys`."""
        n = batch.last.shape[0]
        if batch.keys is None:
            pos_host = batch.pos_host if batch.pos_host is not None else batch.pos.tolist()
            dpos_host = self.rows.draft_pos[:n]
            w = max(p + 1 - d for p, d in zip(pos_host, dpos_host, strict=True))
            logits = self._feed(batch, self.dpos[:n], w, max(dpos_host))
            return self._draft(logits, batch, max(pos_host) + 1)
        dpos = torch.where(batch.live, self.dpos[:n], 0)
        logits = self._feed(batch, dpos, FEED, batch.keys - FEED)
        return self._draft(logits, batch, batch.keys - 1, fixed=True)

    def _feed(self, batch: DraftBatch, dpos: torch.Tensor, width: int, top: int) -> torch.Tensor:
        """Feed each row's history[dpos .. pos] (`width` wide: the tail past a row's own
        count is padding) → its logits at pos, [n, V]; top: max_start of the key axis."""
        n_feed = (batch.pos + 1 - dpos).clamp(1, width)  # [n]
        col = torch.arange(width, device=self.device)
        idx = (dpos.unsqueeze(1) + col).clamp(max=batch.history.shape[1] - 1)  # [n, width]
        return self.model(
            batch.history[: dpos.shape[0]].gather(1, idx),
            positions=dpos,
            cache=self.cache,
            logits_index=(n_feed - 1).unsqueeze(1),
            max_start=top,
        ).logits[:, 0]

    def _draft(
        self, logits: torch.Tensor, batch: DraftBatch, top: int, fixed: bool = False
    ) -> Proposal:
        """The k drafts, sampled from q at the rows' settings; top: the key axis of the
        first draft forward (later ones one further, unless `fixed`)."""
        tokens, probs = [], []
        for i in range(batch.k):
            q = probs_from_logits(logits, batch.sampling)
            u = rng.uniforms(batch.seed, batch.n_gen + i, rng.DRAFT)
            tok = sample_from_probs(q, u)
            tok = torch.where(batch.sampling.greedy, logits.argmax(dim=-1), tok)
            tokens.append(tok)
            probs.append(q)
            if i + 1 < batch.k:
                logits = self.model(
                    tok.unsqueeze(1),
                    positions=batch.pos + 1 + i,
                    cache=self.cache,
                    max_start=top if fixed else top + i,  # no read-back
                ).logits[:, 0]
        return Proposal(tokens=torch.stack(tokens, 1), probs=torch.stack(probs, 1))

    def commit(self, B, pos_before, num_new, hidden, read) -> None:
        k, self._k = self._k, None
        if k is None:
            return  # nothing drafted this step: the cache catches up at the next proposal
        # cached: last + drafts 1..k-1; valid: last + the accepted drafts (num_new - 1)
        valid = 1 + torch.minimum(num_new - 1, torch.full_like(num_new, k - 1))
        self.dpos[:B] = pos_before + valid
        self.rows.draft_pos[:B] = [
            p - e + min(e, k) for p, e in zip(read.pos[:B], read.emitted[:B], strict=True)
        ]

    def move(self, src: int, dst: int) -> None:
        """(After the engine moved the row's host state: `rows` holds it at src too.)"""
        self.cache.move(src, dst, self.rows.draft_pos[src])
        self.dpos[dst] = self.dpos[src]
