"""Log-probs of chosen tokens from the LM head, with and without the full logits.

Cost. The LM head is the widest matmul of the model (SmolLM2: H x V = 576 x 49152, a fifth
of its FLOPs), and materialising [N, T, V] fp32 logits, their log-softmax and the
gradients of both made the head and its element-wise passes ~40% of a CPU train step.
Neither objective of the learner needs the head outside the response: the loss reads
log-probs of response tokens, the draft loss the distributions at the positions that
predict them (the same positions: `drafting.ttt.loss_mask`). So the learner runs the
decoder without its head and computes head + log-softmax + gather at those positions
only, the log-softmax in cache-sized chunks of rows (`head_logprobs`); the backward is
written out (`_HeadLogProbs`) so that the probabilities are its only saved state and
become the logits' gradient in place. The log-probs are the plain path's
(`sequence_logprobs`) row by row (bit for bit on the CPU; tested to 1e-5), the gradients
equal to float rounding.

Top-k / top-p. The log-probs are those of the distribution the engine samples from:
log_softmax of the tempered logits with every token outside the top-k / nucleus set at
-inf (`spec.sampling.truncate`, the engine's own function), i.e. the kept tokens'
probabilities renormalised. Its gradient is the same formula with the truncated
probabilities (the kept set is piecewise constant in the logits). The online draft's
target stays the tempered, untruncated distribution (its proposals are processed by the
same top-k / top-p before verification, so what it learns only moves acceptance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specroll.spec.sampling import Hints, truncate

HEAD_CHUNK_ELEMENTS = 1 << 20
"""Logit elements per chunk of the log-softmax in `head_logprobs` (4 MiB of fp32: 21 rows
of SmolLM2's 49152-wide vocabulary), so that a chunk stays in cache across the passes
that read it (max, sum, write, gather, exp)."""


def truncated(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Tempered logits z [..., V] with the tokens outside the top-k / nucleus set of each
    row at -inf (z itself when both are off): the engine's `truncate` with every row's
    settings equal."""
    if top_k <= 0 and top_p >= 1:
        return z
    n = z.shape[0]
    k = torch.full((n,), int(top_k), dtype=torch.long, device=z.device)
    p = torch.full((n,), float(top_p), device=z.device)
    return truncate(z, k, p, Hints.of([(1.0, int(top_k), float(top_p))]))


def sequence_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """[N, T, V] logits, [N, T] tokens → [N, T] log p(tokens[i] | < i) (0 at i = 0), p the
    processed distribution (temperature, then top-k / top-p).

    The plain path (every position's logits materialised): the reference the learner's
    `head_logprobs` is tested against, and what callers with full logits use."""
    z = logits[:, :-1].float() / temperature
    logp = F.log_softmax(truncated(z, top_k, top_p), dim=-1)
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
    top_k: int = 0,
    top_p: float = 1.0,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The forward of `head_logprobs`, without autograd.

    x: [n, H] (compute dtype), w: [H, V] (compute dtype), targets: [n]. Returns picked
    log-probs [n] fp32 (of the processed distribution: `truncated`), the draft target
    [n, V'] fp32 (tempered log-probs over `vocab`, or None), with `keep_probs` the
    processed probabilities [n, V] fp32 the backward needs, and with `entropy` the
    processed distribution's entropy [n] fp32 (or None).

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
    ent = torch.empty(n, dtype=f32, device=x.device) if entropy else None
    cut = top_k > 0 or top_p < 1
    scratch = None
    for s, e in _chunk_bounds(n, chunk):
        z = logits[s:e].float()  # [c, V] (a view in fp32)
        if temperature != 1.0:
            z.div_(temperature)  # the same rounding as the plain path's z / T
        if scratch is None or scratch.shape[0] != e - s:
            scratch = torch.empty(e - s, V, dtype=f32, device=x.device)
        torch.log_softmax(z, dim=-1, out=scratch)  # [c, V]
        if draft is not None:  # the tempered distribution, untruncated
            torch.index_select(scratch, 1, vocab, out=draft[s:e])
        if cut:  # the processed distribution: -inf outside the kept set
            torch.log_softmax(truncated(z, top_k, top_p), dim=-1, out=scratch)
        picked[s:e] = scratch.gather(1, targets[s:e].unsqueeze(1)).squeeze(1)
        if probs is not None:
            torch.exp(scratch, out=probs[s:e])
        if ent is not None:  # -sum p log p, with 0 log 0 = 0 outside the kept set
            p = probs[s:e] if probs is not None else scratch.exp()
            ent[s:e] = torch.special.entr(p).sum(-1)
    return picked, draft, probs, ent


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
    def forward(ctx, x, w, targets, temperature, chunk, vocab, dtype, top_k, top_p, entropy):
        xc, wc = x.to(dtype), w.to(dtype)
        picked, draft, probs, ent = _head_chunks(
            xc, wc, targets, temperature, chunk, vocab, True, top_k, top_p, entropy
        )
        ctx.save_for_backward(xc, wc, targets, probs)
        ctx.temperature = temperature
        ctx.dtypes = (x.dtype, w.dtype)
        for t in (draft, ent):
            if t is not None:
                ctx.mark_non_differentiable(t)
        return picked, draft, ent

    @staticmethod
    def backward(ctx, g, _g_draft, _g_ent):
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
        return gx, gw, None, None, None, None, None, None, None, None


def head_logprobs(
    x: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    *,
    vocab: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    chunk: int | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    entropy: bool = False,
):
    """Log-probs of `targets` under the processed distribution (temperature, top-k,
    top-p) from final states: the head as one product, the log-softmax in cache-sized
    chunks of rows.

    x: [n, H] normed final states at the n positions that predict `targets` [n]; w: [H, V]
    the LM head. Returns (log p(target) [n] fp32, differentiable in x and w; and with
    `vocab` [V'] the detached tempered log-probs [n, V'] over it: the online draft's
    target), and with `entropy` a third item: the processed distribution's entropy [n]
    (detached; one more pass over each chunk while it is in cache, no extra forward).
    `dtype`: the matmuls' compute dtype (bf16 learner); the log-softmax is fp32 always.
    Equal to `sequence_logprobs` row by row (same operations per row, fewer rows)."""
    chunk = chunk or max(1, HEAD_CHUNK_ELEMENTS // w.shape[1])
    with torch.autocast(x.device.type, enabled=False):
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            out = _HeadLogProbs.apply(
                x, w, targets, temperature, chunk, vocab, dtype, top_k, top_p, entropy
            )
        else:
            with torch.no_grad():
                picked, draft, _, ent = _head_chunks(
                    x.to(dtype),
                    w.to(dtype),
                    targets,
                    temperature,
                    chunk,
                    vocab,
                    False,
                    top_k,
                    top_p,
                    entropy,
                )
            out = (picked, draft, ent)
        return out if entropy else out[:2]
