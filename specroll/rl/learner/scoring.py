"""Scoring a batch under a model: the forward both learner stages share, and stage `logprob`.

Every figure the learner computes starts from the same forward: the decoder over a
micro-batch's tokens, then the head's tempered (top-k / top-p processed) log-softmax at
the positions that predict a response token (`rl.algo.logprobs`). Stage `logprob` is that
forward alone, under no gradient, for the old and the reference policy's log-probs; stage
`train` (`rl.learner.learner`) runs it with a gradient and adds the losses. Keeping the
forward here, apart from the update, is what makes both stages score tokens identically.

`Scorer` holds no state of its own: it is the base of `Learner`, whose policy, placement
and sampling settings it reads.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from specroll.model.transformer import Transformer
from specroll.rl.algo.batch import Batch, MicroBatch, plan_micro_batches, predicting_positions
from specroll.rl.algo.logprobs import head_logprobs
from specroll.rl.config import PolicyConfig
from specroll.rl.learner.shared_prompts import PromptPass

if TYPE_CHECKING:
    from specroll.rl.learner.fsdp.shard import DataParallel


class Scorer:
    """The forward and stage `logprob` of `Learner` (its base)."""

    policy: Transformer
    pcfg: PolicyConfig
    device: torch.device
    dtype: torch.dtype
    temperature: float
    top_k: int
    top_p: float
    hidden_layers: tuple[int, ...]
    dp: DataParallel | None

    def _autocast(self, dtype: torch.dtype | None = None) -> AbstractContextManager:
        """bf16 compute over fp32 weights (a no-op context in fp32); `dtype` overrides the
        learner's."""
        dtype = dtype or self.dtype
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16
        )

    def forward(
        self,
        model: Transformer,
        b: Batch,
        vocab: torch.Tensor | None = None,
        where: tuple[torch.Tensor, torch.Tensor] | None = None,
        entropy: bool = False,
        dtype: torch.dtype | None = None,
        shared: tuple[PromptPass, MicroBatch] | None = None,
    ) -> tuple:
        """One micro-batch's decoder forward and the head at the response positions.

        where: (rows, cols) [n] of the positions that predict a response token (see
        `predicting_positions`; computed from `b` when not given). Returns (logp [B, W]
        fp32, 0 outside the response; the draft target [n, V'] at those positions, which
        are the ones `drafting.ttt.loss_mask` selects, in its order, when `vocab` is
        given; the hidden states `self.hidden_layers`), and with `entropy` a fourth item:
        the processed distribution's entropy [B, W] at the response tokens (0 elsewhere,
        detached). `dtype`: the compute dtype, when not the learner's. `shared`: the
        update's prompt pass and this micro-batch (`shared_prompts`): only the responses
        are run here, on top of their prompts."""
        last = model.cfg.num_layers
        layers = self.hidden_layers if model is self.policy else (last,)
        dtype = dtype or self.dtype
        with self._autocast(dtype):
            if shared is None:
                hidden = model(b.tokens, hidden_layers=layers, return_logits=False).hidden
            else:
                hidden = shared[0].hidden_states(b, shared[1], layers)
        rows, cols = where if where is not None else predicting_positions(b, self.device)
        # the norm over every position, then the rows: an RMSNorm reduction's order
        # depends on the tensor's shape, and these are the plain path's numerics
        final = model.final_state(hidden[last])[rows, cols]  # [n, H]
        picked, target, *ent = head_logprobs(
            final,
            model.head_weight,
            b.tokens[rows, cols + 1],
            self.temperature,
            vocab=vocab,
            dtype=dtype,
            top_k=self.top_k,
            top_p=self.top_p,
            entropy=entropy,
        )
        logp = torch.zeros(b.tokens.shape, device=picked.device)
        res = (logp.index_put((rows, cols + 1), picked), target, hidden)
        if entropy:
            res += (torch.zeros_like(logp).index_put((rows, cols + 1), ent[0]),)
        return res

    # ------------------------------------------------------------------ stage: logprob

    @torch.no_grad()
    def logprobs(
        self, batch: Batch, model: Transformer | None = None, exact: bool = False
    ) -> torch.Tensor:
        """[N, T] tempered log-probs (CPU, fp32) of `batch.tokens` under `model` (default:
        the policy); 0 outside the response. `exact`: in fp32 whatever the learner's
        dtype (over the fp32 master weights: what an fp32 engine samples from)."""
        dtype = torch.float32 if exact else None
        model = model or self.policy
        plan = self._mine(self._micro(batch))
        batch = batch.to(self.device)
        out = torch.zeros(batch.tokens.shape, device=self.device)
        shared = self._prompt_pass(model, batch, plan, dtype)
        for m, real in plan:
            b = batch.rows(m.idx, m.width)
            where = m.where(b, self.device)
            on = None if shared is None else (shared, m)
            logp, _, _ = self.forward(model, b, where=where, dtype=dtype, shared=on)
            if real:
                out[torch.tensor(m.idx, device=self.device), : m.width] = logp
        if self.dp is not None:  # each row was computed on one rank, zeros elsewhere
            self.dp.sum_(out)
        return out.cpu()

    def _prompt_pass(
        self,
        model: Transformer,
        batch: Batch,
        plan: list[tuple[MicroBatch, bool]],
        dtype: torch.dtype | None = None,
    ) -> PromptPass | None:
        """`batch`'s distinct prompts run once under `model` (`shared_prompts`; with
        autograd when it is on), at most a micro-batch's padded tokens; in one process
        only (under data parallelism every rank runs its rows from their first token)."""
        if self.dp is not None or not plan:
            return None
        layers = self.hidden_layers if model is self.policy else (model.cfg.num_layers,)
        limit = max(len(m.idx) * m.width for m, _ in plan)
        with self._autocast(dtype):
            return PromptPass.of(model, batch, layers, limit)

    def _mine(self, plan: list[MicroBatch]) -> list[tuple[MicroBatch, bool]]:
        """(micro-batch, real) pairs this rank runs: all of them, real, in one process;
        under data parallelism its share, padded with dummies (forwards whose results
        count for nothing) so that every rank runs as many forwards and backwards as the
        others (each is a collective under FSDP)."""
        return [(m, True) for m in plan] if self.dp is None else self.dp.share(plan)

    def _micro(self, batch: Batch) -> list[MicroBatch]:
        """Micro-batches of `policy.micro_batch` rows (`plan_micro_batches`)."""
        return plan_micro_batches(batch, self.pcfg.micro_batch)
