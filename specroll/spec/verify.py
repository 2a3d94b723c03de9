"""The rejection verifier of speculative decoding, as one pure tensor function.

Vocabulary (vLLM's): for each row, the drafter proposed `num_draft[b]` tokens (0 allowed).
One target forward scored `num_draft + 1` positions. Walking the drafts in order, draft
i is **accepted** with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection a
**recovered** token is drawn from the residual norm(max(p_i − q_i, 0)) and the row stops;
if every draft was accepted, a **bonus** token is drawn from the target distribution at
the next position. Either way each row emits `accepted + 1` tokens, and the emitted
sequence is distributed exactly as plain sampling from p (Leviathan et al. 2023).

Exactness rules (see DESIGN.md):
* p and q are fp32 distributions after the *same* processors (temperature, top-k,
  top-p) — target logits of any dtype (a bf16 model's) are upcast to fp32 first, and the
  drafter's q is fp32 by construction (`sampling.probs_from_logits`); uniforms are
  float64; acceptance is the strict `u < p/q`, guarded by `q > 0`;
* one-hot drafts (n-gram, greedy drafting: `draft_probs=None`) use q = δ_x, so acceptance
  is p(x) and the residual is p with x removed;
* the residual falls back to p when its mass is ~0 (then p ≈ q and rejection has
  probability ~0; the fallback only guards against division by zero);
* greedy rows (temperature 0) accept while the draft equals the target argmax and emit
  the argmax at the first mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specroll.spec.sampling import RowSampling, sample_from_probs, temper, truncate

RESIDUAL_EPS = 1e-12
"""Residual mass below which the recovered token is drawn from p itself."""


@dataclass
class VerifyOutput:
    tokens: torch.Tensor
    """[B, kmax + 1] emitted ids, −1 after the first `num_emitted[b]`."""
    num_accepted: torch.Tensor
    """[B] accepted drafts (0..num_draft)."""
    accepted: torch.Tensor
    """[B, kmax] bool: draft i was accepted (cumulative: implies all before it were)."""
    logprobs: torch.Tensor
    """[B, kmax + 1] log-prob of each emitted token under the processed distribution it
    was drawn from (temperature, then top-k / top-p: tokens outside the kept set have
    none of its mass; fp32)."""

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: RowSampling,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> VerifyOutput:
    """Accept or reject every row's drafts in one batched pass.

    target_logits: [B, kmax+1, V] raw target logits at the last committed token and each
    draft (any float dtype; upcast to fp32). draft_tokens: [B, kmax] ids (anything beyond
    num_draft is ignored).
    num_draft: [B] in 0..kmax. draft_probs: [B, kmax, V] processed q the drafts were
    sampled from, or None for one-hot drafts. sampling: the rows' settings (the same
    ones the draft used). u_accept: [B, kmax] float64 uniforms for
    the acceptance tests; u_sample: [B, kmax+1] float64 uniforms, u_sample[b, j] drawing
    the recovered/bonus token when row b emits it at position j (so a row's j-th emitted
    token always uses the uniform of its own index, whatever the draft length).
    """
    target_logits = target_logits.float()  # no copy when already fp32
    if draft_probs is not None:
        draft_probs = draft_probs.float()  # exact for any lower-precision q
    B, K1, V = target_logits.shape
    K = K1 - 1
    dev = target_logits.device
    rows = torch.arange(B, device=dev)
    in_draft = torch.arange(K, device=dev) < num_draft.unsqueeze(1)  # [B, K]
    x = torch.where(in_draft, draft_tokens, torch.zeros_like(draft_tokens)).clamp(0, V - 1)
    greedy = sampling.greedy

    # p only where it is needed: at each draft token, and one full row at the stop point
    hints = sampling.hints  # host-side: which processors any row needs (no device reads)
    any_greedy = sampling.any_greedy()
    tempered = temper(target_logits, sampling.temperature, hints)  # [B, K+1, V] fp32
    # processed logits (the same tensor when no row has top-k/p)
    x_all = truncate(tempered, sampling.top_k, sampling.top_p, hints)
    lse = x_all.logsumexp(dim=-1)  # [B, K+1]
    px = (x_all[:, :K].gather(-1, x.unsqueeze(-1)).squeeze(-1) - lse[:, :K]).exp().double()
    if draft_probs is None:
        qx = torch.ones_like(px)
    else:
        qx = draft_probs.gather(-1, x.unsqueeze(-1)).squeeze(-1).double()
    ok = u_accept < acceptance_ratio(px, qx)
    if any_greedy and K > 0:
        argmax = target_logits[:, :K].argmax(dim=-1)  # [B, K]
        ok = torch.where(greedy.unsqueeze(1), x == argmax, ok)
    accepted = (ok & in_draft).long().cumprod(dim=1).bool()  # [B, K]
    n = accepted.sum(dim=1)  # [B]

    # the one distribution each row samples its last token from
    dist = (x_all[rows, n] - lse[rows, n].unsqueeze(1)).exp()  # [B, V] processed target p
    rejected = n < num_draft
    # no draft, no rejection; with drafts the residual is computed for every row and
    # kept where one was rejected (cheaper than asking the device whether any was)
    if K > 0:
        j = n.clamp(max=max(K - 1, 0))
        if draft_probs is None:
            q_j = torch.zeros_like(dist).scatter_(1, x[rows, j].unsqueeze(1), 1.0)
        else:
            q_j = draft_probs[rows, j]
        dist = torch.where(rejected.unsqueeze(1), residual_distribution(dist, q_j), dist)
    last = sample_from_probs(dist, u_sample[rows, n])  # [B]
    if any_greedy:
        last = torch.where(greedy, target_logits[rows, n].argmax(dim=-1), last)

    tokens = torch.full((B, K1), -1, dtype=torch.long, device=dev)
    tokens[:, :K] = torch.where(accepted, x, tokens[:, :K])
    tokens[rows, n] = last
    # the processed distribution's log-prob (what was sampled; the learner scores the
    # same), equal to log_softmax(logits / T) when no row truncates
    lp = x_all.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1) - lse
    return VerifyOutput(tokens=tokens, num_accepted=n, accepted=accepted, logprobs=lp)


def acceptance_ratio(px: torch.Tensor, qx: torch.Tensor) -> torch.Tensor:
    """p(x)/q(x) in float64, and 0 where q(x) = 0 (a token the draft could not have drawn).

    A draft is accepted iff u < ratio with u ~ U[0, 1) float64, i.e. with probability
    min(1, p/q); a zero-probability target token (p = 0) is never accepted, even at u = 0.
    """
    px, qx = px.double(), qx.double()
    return torch.where(qx > 0, px / qx.clamp_min(1e-300), torch.zeros_like(px))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p − q, 0)) over the last axis, falling back to p where the mass is ~0."""
    residual = (p - q).clamp_min(0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > RESIDUAL_EPS, residual / mass.clamp_min(RESIDUAL_EPS), p)


def output_distribution(p: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """Exact distribution of the first emitted token, from the verifier's own pieces.

    p: [V] processed target distribution. q: [V] processed draft distribution (draft
    x ~ q), or None for every possible one-hot draft: then returns [V, V] whose row x is
    the output distribution when the drafter proposed x deterministically. Composed of
    `acceptance_ratio` and `residual_distribution` — the functions `verify` runs — so the
    tests can check analytically that the output is exactly p.
    """
    V = p.shape[-1]
    onehot = torch.eye(V, dtype=p.dtype, device=p.device)  # row x = δ_x
    drafts_q = onehot if q is None else q.expand(V, V)  # q used for each draft x
    accept = acceptance_ratio(p, drafts_q.diagonal()).clamp(max=1)  # [V]: P(accept | x)
    rest = residual_distribution(p.expand(V, V), drafts_q).double()  # [V, V]: row x
    per_draft = accept.unsqueeze(1) * onehot.double() + (1 - accept).unsqueeze(1) * rest
    if q is None:
        return per_draft
    return (q.double().unsqueeze(1) * per_draft).sum(dim=0)
