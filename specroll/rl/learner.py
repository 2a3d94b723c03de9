"""The learner: log-prob recomputation (stage `logprob`) and the update (stage `train`).

One policy forward per micro-batch serves both objectives (paper §2.4, NeMo-RL #2078):
the GRPO/DAPO loss on the policy's log-probs, and the online draft loss (any
`TrainableDraft`: EAGLE-3 reads three aux layers, MTP the final state) on the states of
that *same* forward, read through `detach()` together with the detached policy
distribution as the target. The total is L = L_policy(theta) + lambda * L_draft(phi) with
no path between them: the draft loss cannot move a policy weight and the policy loss
cannot move a draft weight (tested to be exactly zero). Each has its own AdamW and its
own gradient clipping.

Token convention: tokens [N, T] are prompt + response padded; logp[:, i] is the policy's
tempered log-prob of tokens[:, i] given tokens[:, :i] (from the logits at i - 1); the
response mask marks i in [prompt_len, length).

Cost. The LM head is the widest matmul of the model (SmolLM2: H x V = 576 x 49152, a fifth
of its FLOPs), and materialising [N, T, V] fp32 logits, their log-softmax and the
gradients of both made the head and its element-wise passes ~40% of a CPU train step.
Neither objective needs the head outside the response: the loss reads log-probs of
response tokens, the draft loss the distributions at the positions that predict them
(the same positions: `drafters.ttt.loss_mask`). So the learner runs the decoder without
its head and computes head + log-softmax + gather at those positions only, the
log-softmax in cache-sized chunks of rows (`head_logprobs`); the backward is written out
(`_HeadLogProbs`) so that the probabilities are its only saved state and become the
logits' gradient in place. The log-probs are the plain path's (`token_logprobs`) row by
row (bit for bit on the CPU; tested to 1e-5), the gradients equal to float rounding.

Placement: `learner.device` / `learner.dtype`. Batches arrive on the CPU and move to the
learner's device here; `logprobs` returns CPU fp32; `train` returns floats, read once
per update (statistics accumulate on the device). bf16 is autocast over fp32 master
weights and fp32 AdamW state; log-softmax, the loss and the draft loss stay fp32.
"""

from __future__ import annotations

import functools
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from specroll.drafters.trainable import TrainableDraft
from specroll.drafting.train import draft_loss
from specroll.model.transformer import Transformer
from specroll.rl import loss as L
from specroll.rl.config import DraftConfig, LossConfig, PolicyConfig, RolloutConfig

HEAD_CHUNK_ELEMENTS = 1 << 20
"""Logit elements per chunk of the log-softmax in `head_logprobs` (4 MiB of fp32: 21 rows
of SmolLM2's 49152-wide vocabulary), so that a chunk stays in cache across the passes
that read it (max, sum, write, gather, exp)."""


@dataclass
class Batch:
    """Rollouts of one step, padded."""

    tokens: torch.Tensor
    """[N, T] prompt + response ids."""
    prompt_lens: torch.Tensor
    """[N]."""
    lengths: torch.Tensor
    """[N] prompt + response lengths."""
    advantages: torch.Tensor
    """[N] one advantage per sequence."""
    behaviour_logp: torch.Tensor
    """[N, T] the engine's log-probs of the response tokens (0 elsewhere)."""

    @property
    def response_mask(self) -> torch.Tensor:
        i = torch.arange(self.tokens.shape[1], device=self.tokens.device).view(1, -1)
        return (i >= self.prompt_lens.view(-1, 1)) & (i < self.lengths.view(-1, 1))

    @classmethod
    def from_results(cls, results: list, advantages: torch.Tensor) -> Batch:
        """Rollout results (prompt, tokens, engine log-probs) padded into one batch."""
        n = len(results)
        lens = [len(r.prompt_ids) + len(r.token_ids) for r in results]
        W = max(lens)
        tokens = torch.zeros(n, W, dtype=torch.long)
        beh = torch.zeros(n, W)
        for i, r in enumerate(results):
            P = len(r.prompt_ids)
            tokens[i, : lens[i]] = torch.tensor(r.prompt_ids + r.token_ids)
            beh[i, P : lens[i]] = torch.tensor(r.logprobs)
        return cls(
            tokens,
            torch.tensor([len(r.prompt_ids) for r in results]),
            torch.tensor(lens),
            advantages.float(),
            beh,
        )

    def to(self, device: torch.device | str) -> Batch:
        """The batch on `device` (itself when it is there already)."""
        if self.tokens.device == torch.device(device):
            return self
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))

    def rows(self, idx: list[int], width: int | None = None) -> Batch:
        """Rows `idx`, cut to their widest length (`width`, when the caller knows it,
        saves reading the lengths back from the device)."""
        if width is None:
            width = int(self.lengths[idx].max())
        sel = torch.tensor(idx, device=self.tokens.device)
        return Batch(
            self.tokens[sel, :width],
            self.prompt_lens[sel],
            self.lengths[sel],
            self.advantages[sel],
            self.behaviour_logp[sel, :width],
        )


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N, T, V] logits, [N, T] tokens → [N, T] log p(tokens[i] | < i) (0 at i = 0).

    The plain path (every position's logits materialised): the reference the learner's
    `head_logprobs` is tested against, and what callers with full logits use."""
    logp = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)  # [N, T-1]
    return F.pad(picked, (1, 0))


def _head_chunks(
    x: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
    vocab: torch.Tensor | None,
    keep_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The forward of `head_logprobs`, without autograd.

    x: [n, H] (compute dtype), w: [H, V] (compute dtype), targets: [n]. Returns picked
    log-probs [n] fp32, the draft target [n, V'] fp32 (log-probs over `vocab`, or None)
    and, with `keep_probs`, the probabilities [n, V] fp32 the backward needs.

    The logits are one GEMM over all n rows (a GEMM of a few rows against the [H, V] head
    re-reads and re-packs all of it: chunks of 170 rows ran ~25% slower); the
    log-softmax, gather and exp then run chunk by chunk on cache-sized rows, and in fp32
    the probabilities overwrite the logits they came from (one [n, V] buffer)."""
    n, V = x.shape[0], w.shape[1]
    f32 = torch.float32
    logits = _rows_matmul(x, w)  # [n, V] in the compute dtype
    probs = None
    if keep_probs:
        probs = logits if logits.dtype == f32 else torch.empty(n, V, dtype=f32, device=x.device)
    picked = torch.empty(n, dtype=f32, device=x.device)
    draft = None
    if vocab is not None:
        draft = torch.empty(n, vocab.numel(), dtype=f32, device=x.device)
    scratch = None
    for s, e in _chunk_bounds(n, chunk):
        z = logits[s:e].float()  # [c, V] (a view in fp32)
        if temperature != 1.0:
            z.div_(temperature)  # the same rounding as the plain path's z / T
        if scratch is None or scratch.shape[0] != e - s:
            scratch = torch.empty(e - s, V, dtype=f32, device=x.device)
        torch.log_softmax(z, dim=-1, out=scratch)  # [c, V]
        picked[s:e] = scratch.gather(1, targets[s:e].unsqueeze(1)).squeeze(1)
        if draft is not None:
            torch.index_select(scratch, 1, vocab, out=draft[s:e])
        if probs is not None:
            torch.exp(scratch, out=probs[s:e])
    return picked, draft, probs


def _chunk_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of at most `chunk` rows (+1), none of a single row unless
    n = 1 (see `_rows_matmul`)."""
    bounds = [(s, min(n, s + chunk)) for s in range(0, n, chunk)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def _rows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w with every row's result independent of how many rows are multiplied.

    CPU BLAS computes a one-row product as a GEMV, whose summation order differs from the
    GEMM that the plain path's many rows take (every M >= 2 gives the same bits per row);
    a lone row is multiplied as two, so the chunked head reproduces the plain logits."""
    if x.shape[0] == 1:
        return (x.expand(2, -1) @ w)[:1]
    return x @ w


class _HeadLogProbs(torch.autograd.Function):
    """LM head + log-softmax + gather with a hand-written backward.

    Autograd through the plain ops would keep the [n, V] log-softmax output and then
    allocate a zero [n, V] tensor (gather's backward), a log-softmax gradient and a
    division gradient; here the probabilities p (saved where the logits were) turn into
    the logits' gradient in place: dL/dz = g * (onehot(target) - p) / T, the element-wise
    formula autograd's log-softmax backward evaluates. The saved state is consumed:
    backward runs once (no `retain_graph`)."""

    @staticmethod
    def forward(ctx, x, w, targets, temperature, chunk, vocab, dtype):
        xc, wc = x.to(dtype), w.to(dtype)
        picked, draft, probs = _head_chunks(xc, wc, targets, temperature, chunk, vocab, True)
        ctx.save_for_backward(xc, wc, targets, probs)
        ctx.temperature = temperature
        ctx.dtypes = (x.dtype, w.dtype)
        if draft is not None:
            ctx.mark_non_differentiable(draft)
        return picked, draft

    @staticmethod
    def backward(ctx, g, _g_draft):
        xc, wc, targets, probs = ctx.saved_tensors
        if probs is None:
            raise RuntimeError("head_logprobs: backward ran twice (its saved state is consumed)")
        grad = probs.mul_(-g.unsqueeze(1))  # [n, V]: -g p
        grad.scatter_add_(1, targets.unsqueeze(1), g.unsqueeze(1))  # + g at the target
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        grad = grad.to(wc.dtype)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = (grad @ wc.T).to(ctx.dtypes[0])  # [n, H]
        if ctx.needs_input_grad[1]:
            gw = (xc.T @ grad).to(ctx.dtypes[1])  # [H, V]
        return gx, gw, None, None, None, None, None


def head_logprobs(
    x: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    vocab: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tempered log-probs of `targets` from final states: the head as one product, the
    log-softmax in cache-sized chunks of rows.

    x: [n, H] normed final states at the n positions that predict `targets` [n]; w: [H, V]
    the LM head. Returns (log p(target) [n] fp32, differentiable in x and w; and with
    `vocab` [V'] the detached log-probs [n, V'] over it: the online draft's target).
    `dtype`: the matmuls' compute dtype (bf16 learner); the log-softmax is fp32 always.
    Equal to `token_logprobs` row by row (same operations per row, fewer rows)."""
    chunk = chunk or max(1, HEAD_CHUNK_ELEMENTS // w.shape[1])
    with torch.autocast(x.device.type, enabled=False):
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return _HeadLogProbs.apply(x, w, targets, temperature, chunk, vocab, dtype)
        with torch.no_grad():
            picked, draft, _ = _head_chunks(
                x.to(dtype), w.to(dtype), targets, temperature, chunk, vocab, False
            )
        return picked, draft


def predicting_positions(
    b: Batch, device: torch.device, prompt_lens: list[int] | None = None, lengths=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) [n] of the positions whose next token is a response token, row-major.

    Position i predicts token i + 1, so row r contributes prompt_len - 1 .. length - 2:
    the positions `drafters.ttt.loss_mask` marks, in the order `tensor[mask]` reads them
    (the online draft's target rows). Built on the host from the lengths (pass them when
    they are known there) and copied over: indexing with them needs no device sync."""
    prompt_lens = b.prompt_lens.tolist() if prompt_lens is None else prompt_lens
    lengths = b.lengths.tolist() if lengths is None else lengths
    spans = list(zip(prompt_lens, lengths, strict=True))
    rows = [torch.full((n - p,), r, dtype=torch.long) for r, (p, n) in enumerate(spans)]
    cols = [torch.arange(p - 1, n - 1) for p, n in spans]
    rc = torch.stack([torch.cat(rows), torch.cat(cols)]).to(device, non_blocking=True)
    return rc[0], rc[1]


@dataclass
class _Micro:
    """One micro-batch as the learner runs it (rows of the batch it was cut from)."""

    idx: list[int]
    """Rows of the batch (ascending length)."""
    width: int
    """Their widest length."""
    prompt_lens: list[int]
    """Their prompt lengths."""
    lengths: list[int]
    """Their lengths."""

    def where(self, b: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`predicting_positions` of the micro-batch `b` (cut with these rows)."""
        return predicting_positions(b, device, self.prompt_lens, self.lengths)


class Learner:
    """Policy (+ optional online draft) optimisation on `device` in `dtype`.

    On the CPU, constructing one also makes glibc keep freed memory for reuse in this
    process (`keep_freed_memory`)."""

    def __init__(
        self,
        policy: Transformer,
        *,
        policy_cfg: PolicyConfig,
        loss_cfg: LossConfig,
        rollout_cfg: RolloutConfig,
        draft: TrainableDraft | None = None,
        draft_cfg: DraftConfig | None = None,
        reference: Transformer | None = None,
        decoupled: bool = False,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.decoupled = decoupled
        """Reweight by pi_prox / pi_behaviour (async: samples from older policies)."""
        self.device, self.dtype = torch.device(device), dtype
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"learner dtype must be float32 or bfloat16, got {dtype}")
        self.policy, self.pcfg, self.lcfg = policy, policy_cfg, loss_cfg
        self.temperature = rollout_cfg.temperature
        """The sampling temperature, read from the config the engine's requests come from:
        the log-probs of the update are those of the distribution that was sampled."""
        self.draft = draft if (draft is not None and draft_cfg and draft_cfg.online) else None
        self.dcfg = draft_cfg
        self.reference = reference
        self._share = functools.partial(L.micro_share, token_level=loss_cfg.token_level)
        """The loss variant, chosen once: this micro-batch's share of the aggregate."""
        if self.device.type == "cpu":
            keep_freed_memory()
        # master weights stay fp32 wherever the learner computes (`.to` moves parameters in
        # place, so a draft that references the policy's embedding keeps referencing it)
        policy.to(self.device).for_training()
        if reference is not None:
            # scored exactly like the policy (no prepacked copies): KL = 0 at step 0
            reference.to(self.device).for_training()
        if draft is not None:
            draft.to(self.device)
        self.opt = torch.optim.AdamW(
            policy.parameters(),
            lr=policy_cfg.lr,
            betas=(0.9, 0.99),
            weight_decay=policy_cfg.weight_decay,
            **_fused(self.device),
        )
        self.hidden_layers: tuple[int, ...] = (policy.cfg.num_layers,)
        """Policy states the train forward returns: the last (the LM head's input) and
        what the online draft reads."""
        self.draft_opt = None
        if self.draft is not None:
            self.hidden_layers = tuple(sorted({*self.draft.aux_layers, policy.cfg.num_layers}))
            self.draft.for_training()
            self.draft_opt = torch.optim.AdamW(
                self.draft.parameters(), lr=draft_cfg.lr, betas=(0.9, 0.95), **_fused(self.device)
            )

    def _autocast(self) -> AbstractContextManager:
        """bf16 compute over fp32 weights (a no-op context in fp32)."""
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16
        )

    def _forward(
        self,
        model: Transformer,
        b: Batch,
        vocab: torch.Tensor | None = None,
        where: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, torch.Tensor]]:
        """One micro-batch's decoder forward and the head at the response positions.

        where: (rows, cols) [n] of the positions that predict a response token (see
        `predicting_positions`; computed from `b` when not given). Returns (logp [B, W]
        fp32, 0 outside the response; the draft target [n, V'] at those positions, which
        are the ones `drafters.ttt.loss_mask` selects, in its order, when `vocab` is
        given; the hidden states `self.hidden_layers`)."""
        last = model.cfg.num_layers
        layers = self.hidden_layers if model is self.policy else (last,)
        with self._autocast():
            out = model(b.tokens, hidden_layers=layers, return_logits=False)
        rows, cols = where if where is not None else predicting_positions(b, self.device)
        # the norm over every position, then the rows: an RMSNorm reduction's order
        # depends on the tensor's shape, and these are the plain path's numerics
        final = model.final_state(out.hidden[last])[rows, cols]  # [n, H]
        picked, target = head_logprobs(
            final,
            model.head_weight,
            b.tokens[rows, cols + 1],
            self.temperature,
            vocab=vocab,
            dtype=self.dtype,
        )
        logp = torch.zeros(b.tokens.shape, device=picked.device)
        return logp.index_put((rows, cols + 1), picked), target, out.hidden

    # ------------------------------------------------------------------ stage: logprob

    @torch.no_grad()
    def logprobs(self, batch: Batch, model: Transformer | None = None) -> torch.Tensor:
        """[N, T] tempered log-probs (CPU, fp32) of `batch.tokens` under `model` (default:
        the policy); 0 outside the response."""
        model = model or self.policy
        plan = self._micro(batch)
        batch = batch.to(self.device)
        out = torch.zeros(batch.tokens.shape, device=self.device)
        for m in plan:
            b = batch.rows(m.idx, m.width)
            logp, _, _ = self._forward(model, b, where=m.where(b, self.device))
            out[torch.tensor(m.idx, device=self.device), : m.width] = logp
        return out.cpu()

    def _micro(self, batch: Batch) -> list[_Micro]:
        """Micro-batches of `policy.micro_batch` rows in ascending length (little padding),
        planned from the lengths on the host (one read for the whole batch)."""
        lengths, prompts = batch.lengths.tolist(), batch.prompt_lens.tolist()
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        m = self.pcfg.micro_batch
        chunks = [order[i : i + m] for i in range(0, len(order), m)]
        return [
            _Micro(c, max(lengths[i] for i in c), [prompts[i] for i in c], [lengths[i] for i in c])
            for c in chunks
        ]

    # ------------------------------------------------------------------ stage: train

    def train(
        self,
        batch: Batch,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None = None,
    ) -> dict:
        """`updates_per_step` optimizer steps over disjoint parts of the batch; the mean
        statistics of the updates, as floats.

        old_logp: [N, T] the old policy's log-probs (stage `logprob`, or the engine's), or
        None for an on-policy step with one update: the old log-probs are then the train
        forward's own, detached, which is what recomputing them would give (same weights,
        same operations) without the extra forward."""
        if old_logp is None and self.lcfg.updates_per_step != 1:
            raise ValueError(
                "old_logp=None (the train forward's own log-probs) needs loss.updates_per_step"
                f" = 1 (the weights change between updates); got {self.lcfg.updates_per_step}"
            )
        batch = batch.to(self.device)
        old_logp = old_logp.to(self.device) if old_logp is not None else None
        ref_logp = ref_logp.to(self.device) if ref_logp is not None else None
        N = batch.tokens.shape[0]
        perm = list(range(N))
        parts = [perm[u :: self.lcfg.updates_per_step] for u in range(self.lcfg.updates_per_step)]
        stats: dict[str, list] = {}
        for part in parts:
            if part:
                for k, v in self._update(batch, part, old_logp, ref_logp).items():
                    stats.setdefault(k, []).append(v)
        out: dict = {}
        for k, v in stats.items():  # mean over updates (per position for lists)
            out[k] = (
                [sum(x) / len(v) for x in zip(*v, strict=True)]
                if isinstance(v[0], list)
                else sum(v) / len(v)
            )
        return out

    def _update(self, batch: Batch, part: list[int], old_logp, ref_logp) -> dict:
        sel = torch.tensor(part, device=self.device)
        sub = Batch(*(getattr(batch, f.name)[sel] for f in fields(Batch)))
        old_logp = old_logp[sel] if old_logp is not None else None
        ref_logp = ref_logp[sel] if ref_logp is not None else None
        n_tokens = float(sub.response_mask.sum().clamp(min=1))
        n_seqs = float(len(part))
        cap = L.weight_cap(self.lcfg, self.decoupled)
        use_ref = self.lcfg.kl_coef > 0 and ref_logp is not None
        self.opt.zero_grad(set_to_none=True)
        if self.draft_opt is not None:
            self.draft_opt.zero_grad(set_to_none=True)
        # statistics as device tensors: one host read per update, not per micro-batch
        # (float64: the sums of per-micro-batch fp32 figures are the host's double sums)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        acc = {"policy_loss": zero, "clip_frac": zero, "kl": zero, "draft_loss": zero}
        if cap is not None and self.lcfg.tis_cap > 0:
            acc["tis_clip_frac"] = zero
        draft_acc: list[list[float]] = []
        vocab = self._draft_vocab()
        for m in self._micro(sub):
            b = sub.rows(m.idx, m.width)
            rows = torch.tensor(m.idx, device=self.device)
            W = m.width
            mask = b.response_mask
            logp, target, hidden = self._forward(self.policy, b, vocab, m.where(b, self.device))
            per_tok, terms = L.token_objective(
                logp,
                old_logp[rows, :W] if old_logp is not None else logp.detach(),
                b.advantages,
                self.lcfg,
                behaviour_logp=b.behaviour_logp,
                cap=cap,
                ref_logp=ref_logp[rows, :W] if use_ref else None,
            )
            loss = self._share(per_tok, mask, n_tokens, n_seqs)
            acc["policy_loss"] = acc["policy_loss"] + loss.detach()
            acc["clip_frac"] = acc["clip_frac"] + _share(terms["clipped"] * mask, n_tokens)
            if "kl" in terms:
                acc["kl"] = acc["kl"] + _share(terms["kl"] * mask, n_tokens)
            if "tis_clip_frac" in acc:
                acc["tis_clip_frac"] = acc["tis_clip_frac"] + _share(
                    terms["capped"] & mask, n_tokens
                )
            total = loss
            if self.draft is not None:
                dl, dm = self._draft_loss(b, hidden, target)
                total = total + self.dcfg.weight * dl * (len(m.idx) / n_seqs)
                acc["draft_loss"] = acc["draft_loss"] + dl.detach().double() * len(m.idx) / n_seqs
                draft_acc.append(dm["accept"])
            total.backward()
        acc["grad_norm"] = torch.nn.utils.clip_grad_norm_(
            self.policy.parameters(), self.pcfg.grad_clip
        )
        self.opt.step()
        if self.draft_opt is not None:
            params = list(self.draft.parameters())
            acc["draft_grad_norm"] = torch.nn.utils.clip_grad_norm_(params, self.dcfg.grad_clip)
            self.draft_opt.step()
        keys = list(acc)
        values = torch.stack([acc[k].double() for k in keys]).tolist()  # the one host read
        out: dict = dict(zip(keys, values, strict=True))
        if self.draft_opt is not None:
            out["draft_accept"] = [  # mean over the micro-batches that reached step j
                sum(a[j] for a in draft_acc if not math.isnan(a[j]))
                / max(1, sum(not math.isnan(a[j]) for a in draft_acc))
                for j in range(len(draft_acc[0]))
            ]
        return out

    def _draft_vocab(self) -> torch.Tensor | None:
        """Target ids of the online draft's vocabulary on the learner's device (all ids:
        an arange, when the draft predicts the whole vocabulary); None without a draft."""
        if self.draft is None:
            return None
        v = self.draft.vocab
        if v is None:
            return torch.arange(self.policy.cfg.vocab_size, device=self.device)
        return v.to(self.device)

    def _draft_loss(
        self, b: Batch, hidden: dict[int, torch.Tensor], target: torch.Tensor
    ) -> tuple[torch.Tensor, dict]:
        """Online draft loss on this forward's detached features and distribution.

        target: [n, V'] the policy's tempered log-probs over the draft vocabulary at the
        positions `loss_mask` selects (computed by `_forward` with the policy's head)."""
        d = self.draft
        states = [hidden[i].detach() for i in d.aux_layers]
        aux = (
            torch.cat(states, dim=-1)
            if states
            else hidden[self.policy.cfg.num_layers].new_zeros((*b.tokens.shape, 0))
        )
        final = None
        if d.reads_final:
            with torch.no_grad():
                final = self.policy.final_state(hidden[self.policy.cfg.num_layers])

        def target_logp(mask: torch.Tensor) -> torch.Tensor:
            return target  # the rows of `mask` (the same positions, the same order)

        with self._autocast():
            return draft_loss(
                d,
                b.tokens,
                aux=aux,
                final=final,
                lengths=b.lengths,
                prompt_lens=b.prompt_lens,
                target_logp=target_logp,
                steps=self.dcfg.ttt_steps,
                decay=self.dcfg.step_decay,
            )


def _share(x: torch.Tensor, n: float) -> torch.Tensor:
    """sum(x) / n in float64 (a micro-batch's share of a per-token statistic)."""
    return x.sum().double() / n


def _fused(device: torch.device) -> dict:
    """AdamW's fused kernel where this torch has one for the device: one pass over each
    parameter instead of ~10 element-wise kernels (SmolLM2 on the CPU, one thread:
    0.30 s vs 0.78 s per step with the gradient clipping; numerics to float rounding)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        supported = device.type in _get_fused_kernels_supported_devices()
    except ImportError:  # a torch without the helper: the default implementation
        supported = False
    return {"fused": True} if supported else {}


_KEEP_FREED = False


def keep_freed_memory(limit: int = 1 << 30) -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the kernel.

    glibc serves each allocation above its mmap threshold (dynamic, a few MiB) with a
    fresh mapping and unmaps it on free, so every micro-batch's activations, logits and
    gradients (10 MB to 1 GB each) are page-faulted in and zeroed by the kernel again.
    On the 2-core VM that was a fifth of stage `train` (system time; one thread,
    SmolLM2, 16 sequences: 30.5 s -> 23.8 s). Here blocks below `limit` come from the
    heap and freed memory stays in it (the heap is never trimmed): the process keeps its
    peak. Process-wide (the engine in the same process benefits too),
    idempotent; a no-op without glibc. Returns whether it applies."""
    global _KEEP_FREED
    if _KEEP_FREED:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has no mallopt knobs)
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        ok = libc.mallopt(m_mmap_threshold, ctypes.c_int(min(limit, 2**31 - 1))) == 1
        ok = ok and libc.mallopt(m_trim_threshold, ctypes.c_int(-1)) == 1  # never trim
    except (OSError, AttributeError):
        return False
    _KEEP_FREED = ok
    return ok
