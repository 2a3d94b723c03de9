"""How far the engine's log-probs may lie from the learner's recomputation, and why.

The engine and the learner run the same model code on the same weights, but not the same
floating-point computation. Measured differences in logits for the same tokens:

    source                                                   tiny models   SmolLM2-135M
    GEMM kernel: oneDNN-prepacked (engine) vs plain matmul      0            3.3e-4
      (the learner's, so that autograd and weight updates
      need no repacking), same full-sequence input
    attention over the KV cache (1 or k + 1 queries, key     5e-6 / 8e-6    8e-5 / 9e-5
      length = cache window) vs one causal forward, same
      kernels (plain / 4-token verify pattern)
    batch composition (1 row vs 2 rows, same kernels)           -            4e-5 - 5e-5

None of these is a bug and none can be removed cheaply in fp32: it would take one GEMM
kernel and one attention reduction order shared by an incremental, batched, grad-free
engine and a full-sequence autograd learner.

So the bound is stated in logit units. If every logit differs by at most `eps_logit`,
then for log_softmax(z / T):

    |d log p_i| <= |d z_i| / T + |d logsumexp(z / T)| <= eps / T + max_j |d z_j| / T
                <= 2 * eps_logit / T,

because logsumexp is 1-Lipschitz in the max norm. Lower temperatures amplify the same
logit error: the measured log-prob mismatch grows as 1 / T while the logit error does not.

`EPS_LOGIT` is measured: plain decoding and speculative decoding with FixedDepth(3) and
the `self` / `ngram` drafters, T = 1, 0.7, 0.45, 64 new tokens from 4-8 prompts (random
ids, and the math prompts of the default recipe for SmolLM2); max over every emitted token
of max over the vocabulary of |z_engine - z_learner|, learner = `Learner.logprobs`' path:

    model                              layers  max |z|  max |d logit|   max |d logp|
    tiny test models (hidden 64)          2-4    3-6     7.0e-6          6.2e-6
    SmolLM2-135M-Instruct (fp32)           30    ~45     3.7e-4          9.8e-5

The error grows with depth and with the logit scale (a 4-layer model with 0.4-std weights
reaches 1.1e-4 in log-probs), so a larger policy may need a larger `eps_logit`: measure it
the same way (`logprob_mismatch_max` per step gives the log-prob side). The bound is a
worst case: measured log-prob differences sit 5-30x below 2 * max|d logit| / T, because
the log-normaliser moves by a probability-weighted average of the logit errors.
"""

from __future__ import annotations

import torch

EPS_LOGIT = 1e-3
"""Bound on |z_engine - z_learner| in logit units for fp32 policies up to SmolLM2's size:
2.7x the largest difference measured on SmolLM2-135M (3.7e-4), 140x the tiny models'."""


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
