"""How far the engine's log-probs may lie from the learner's recomputation, and why.

The engine and the learner run the same model code on the same weights, but not the same
floating-point computation: prepacked GEMM kernels (engine) vs plain matmuls (learner,
for autograd), attention over a KV cache vs one causal forward, and batch composition
each move the logits by float rounding (measured in docs/performance_notes.md). None of
these is a bug and none can be removed cheaply in fp32: it would take one GEMM kernel and
one attention reduction order shared by an incremental, batched, grad-free engine and a
full-sequence autograd learner.

So the bound is stated in logit units. If every logit differs by at most `eps_logit`,
then for log_softmax(z / T):

    |d log p_i| <= |d z_i| / T + |d logsumexp(z / T)| <= eps / T + max_j |d z_j| / T
                <= 2 * eps_logit / T,

because logsumexp is 1-Lipschitz in the max norm. Lower temperatures amplify the same
logit error: the measured log-prob mismatch grows as 1 / T while the logit error does not.
A larger policy may need a larger `eps_logit`: measure it as the notes describe
(`logprob_mismatch_max` per step gives the log-prob side).
"""

from __future__ import annotations

import torch

EPS_LOGIT = 1e-3
"""Bound on |z_engine - z_learner| in logit units for fp32 policies up to SmolLM2's size
(a margin over the largest difference measured: docs/performance_notes.md)."""


def logprob_tolerance(temperature: float, eps_logit: float = EPS_LOGIT) -> float:
    """Largest |engine log-prob - learner log-prob| implied by a logit error of `eps_logit`.

    Log-probs are log_softmax(z / T), so the logit error is scaled by 1 / T and enters
    twice (the token's own logit and the log-normaliser): 2 * eps_logit / T. Greedy
    (temperature <= 0) log-probs are reported under T = 1.
    """
    t = temperature if temperature > 0 else 1.0
    return 2.0 * eps_logit / t


def mismatch_stats(
    engine_logp: torch.Tensor, learner_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float | None]:
    """The rollout-learner mismatch statistics of the RL literature, on the sampled tokens.

    engine_logp, learner_logp: [N, T] log-probs of the same tokens (the engine's, which
    sampled them, and the learner's recomputation); mask: [N, T] bool, the tokens to
    compare. Returns the mean and max |d log p| and the k3 estimate of
    KL(pi_engine || pi_learner): with r = pi_learner / pi_engine on tokens drawn from the
    engine, E[r - 1 - log r] is that KL, and every term is >= 0 (Schulman 2020). All
    None when the mask is empty (no on-policy token to compare).
    """
    m = mask.bool()
    if not bool(m.any()):
        return {"logprob_mismatch_mean": None, "logprob_mismatch_max": None, "mismatch_kl": None}
    d = (learner_logp.double() - engine_logp.double())[m]  # [n] log r
    return {
        "logprob_mismatch_mean": float(d.abs().mean()),
        "logprob_mismatch_max": float(d.abs().max()),
        "mismatch_kl": float((torch.expm1(d) - d).mean()),
    }
