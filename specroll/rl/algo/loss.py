"""GRPO / DAPO objective as pure tensor functions, one per concern.

GRPO (DeepSeekMath, arXiv 2402.03300) on the advantages of `algo.advantages`. DAPO
(arXiv 2503.14476) adds asymmetric clipping ("clip-higher", eps_low < eps_high keeps
low-probability tokens able to grow) and token-level aggregation (every token of the batch
weighs the same, so long answers are not down-weighted), each its own function here (its
group filter and overlong penalty shape the advantages). Dr. GRPO (arXiv 2503.20783)
removes the per-sequence mean (a constant normaliser instead). A KL penalty to a
reference policy (k1, k2 or k3 estimator, Schulman 2020) is optional. Shapes: per-token
tensors [N, T] with a response mask (True = a generated token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specroll.rl.config import LossConfig


def clipped_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO surrogate to *minimise* and a clipped-token indicator.

    logp, old_logp: [N, T]; advantages: [N] (one per sequence) or [N, T].
    loss = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), r = exp(logp - old_logp).
    The indicator marks tokens where the clip binds (their gradient is zero): r below
    1 - clip_low with A < 0, or above 1 + clip_high with A > 0 (`clip_sides` splits them).
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    unclipped_obj, clipped_obj = ratio * adv, clipped * adv
    loss = -torch.minimum(unclipped_obj, clipped_obj)
    return loss, (clipped_obj < unclipped_obj).float()


def clip_sides(
    ratio: torch.Tensor, clipped: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, T] low, [N, T] high) float indicators of where the clip bound: the lower bound
    (ratio too small, A < 0) and the upper one (ratio too large, A > 0). ratio, clipped:
    [N, T] (`clipped_objective`'s indicator); advantages [N] or [N, T]. low + high =
    clipped."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    low = clipped * (ratio < 1).float() * (adv < 0).float()
    return low, clipped - low


def importance_weight(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated per-token importance weight min(pi_old / pi_behaviour, cap), and where the
    cap bit. old_logp, behaviour_logp: [N, T] -> ([N, T] weight, [N, T] bool capped).

    pi_old is the learner's (recomputed, no-grad) policy, pi_behaviour the distribution the
    engine sampled from (its recorded log-probs). Two corrections reweight by this ratio:

    * decoupled PPO (Hilton et al. 2021), asynchronous RL: a sample was drawn by the policy
      of an older step, the clipped ratio is taken against the recomputed current
      ("proximal") policy, and the surrogate is reweighted by pi_prox / pi_behaviour;
    * truncated importance sampling (TIS), the rollout-learner mismatch: a bf16 or GPU
      engine samples from a slightly different distribution than the learner scores, and
      the weight corrects the policy gradient for it.

    Truncation bounds the variance a near-zero pi_behaviour would add. No gradient flows
    through the weight: it rescales each token's gradient, it is not optimised.
    """
    ratio = torch.exp(old_logp - behaviour_logp).detach()
    return ratio.clamp(max=cap), ratio > cap


def weight_cap(cfg: LossConfig, decoupled: bool) -> float | None:
    """The cap of the importance weight this run applies, or None when no correction is on.

    Decoupled PPO (`decoupled`: async, cap `behaviour_weight_cap`) and TIS (`tis_cap` > 0)
    weigh by the same ratio pi_old / pi_behaviour: in async RL the behaviour policy is the
    engine's distribution of an older step, so the one ratio carries both the staleness and
    the engine-learner mismatch. When both are on, the weight is applied once (applying it
    twice would square it), truncated at the smaller cap: each cap is a bound the run asked
    for, and the smaller one honours both."""
    caps = ([cfg.behaviour_weight_cap] if decoupled else []) + (
        [cfg.tis_cap] if cfg.tis_cap > 0 else []
    )
    return min(caps) if caps else None


def token_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    cfg: LossConfig,
    *,
    behaviour_logp: torch.Tensor | None = None,
    cap: float | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token loss to minimise ([N, T]) and its per-token statistics (detached).

    logp: the policy's log-probs (with gradient); old_logp: the learner's no-grad ones;
    behaviour_logp: the engine's (needed when `cap` is set: see `importance_weight`);
    ref_logp: the reference policy's (KL penalty when `cfg.kl_coef` > 0). The importance
    weight multiplies the clipped surrogate only, not the KL penalty. Statistics:
    `clipped`, `clip_low`, `clip_high` (float), `ratio` (pi / pi_old), `support` (bool:
    False where the token is outside the processed distribution of pi or pi_old, see
    below), and `capped` (bool) with a weight, `kl` with a penalty.

    Top-k / top-p rollouts: a token outside the nucleus of the policy being scored has
    log-prob -inf (the distribution the engine samples from gives it no mass). That is
    possible for samples of an older policy (async, several updates per step) or at the
    nucleus boundary by float rounding; such a token contributes no loss (the ratio of two
    -inf is undefined) and is counted by `support`.
    """
    # applied whether or not any token is outside (asking would be a device sync): where
    # every token is inside, the values and gradients are those without the masking
    support = torch.isfinite(logp.detach()) & torch.isfinite(old_logp)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(support, logp, zero)
    old_logp = torch.where(support, old_logp, zero)
    if ref_logp is not None:
        ref_logp = torch.where(support, ref_logp, zero)
    per_tok, clipped = clipped_objective(logp, old_logp, advantages, cfg.clip_low, cfg.clip_high)
    ratio = torch.exp(logp.detach() - old_logp)
    low, high = clip_sides(ratio, clipped.detach(), advantages)
    terms = {
        "clipped": clipped.detach(),
        "clip_low": low,
        "clip_high": high,
        "ratio": ratio,
        "support": support,
    }
    if cap is not None:
        if behaviour_logp is None:
            raise ValueError("an importance-weight cap needs the engine's behaviour_logp")
        weight, terms["capped"] = importance_weight(old_logp, behaviour_logp, cap)
        per_tok = per_tok * weight
    if cfg.kl_coef > 0 and ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, cfg.kl_estimator)
        per_tok = per_tok + cfg.kl_coef * kl
        terms["kl"] = kl.detach()
    return torch.where(support, per_tok, zero), terms


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) on tokens drawn from pi ([N, T]), with
    log r = ref_logp - logp (Schulman 2020): 'k1' = -log r (unbiased, can be negative),
    'k2' = (log r)^2 / 2 (low variance, biased), 'k3' = r - 1 - log r (unbiased, >= 0)."""
    if kind == "k3":
        return kl_k3(logp, ref_logp)
    d = ref_logp - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    raise ValueError(f"loss.kl_estimator must be one of ('k1', 'k2', 'k3'), got {kind!r}")


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, max_len: int | None = None
) -> torch.Tensor:
    """Reduce [N, T] to a scalar over masked tokens (`loss.aggregation`):

    * 'token_mean' (DAPO): sum / total tokens: every token weighs the same;
    * 'seq_mean_token_mean' (GRPO): mean per sequence, then mean over sequences: a token
      of a short answer weighs more than one of a long answer;
    * 'seq_mean_token_sum_norm' (Dr. GRPO): sum per sequence / `max_len` (a constant, the
      generation budget), then mean over sequences: no length bias either way."""
    m = mask.float()
    return micro_share(per_token, mask, m.sum().clamp(min=1), mask.shape[0], aggregation, max_len)


def micro_share(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    n_tokens: float,
    n_seqs: float,
    aggregation: str,
    max_len: int | None = None,
) -> torch.Tensor:
    """One micro-batch's share of `aggregate` over the whole update (n_tokens masked
    tokens in n_seqs sequences): the shares of all micro-batches sum to the aggregate, so
    accumulating their gradients gives the full batch's."""
    m = mask.float()
    if aggregation == "token_mean":
        return (per_token * m).sum() / n_tokens
    if aggregation == "seq_mean_token_mean":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).sum() / n_seqs
    if aggregation == "seq_mean_token_sum_norm":
        if not max_len:
            raise ValueError("aggregation 'seq_mean_token_sum_norm' needs max_len (the budget)")
        return (per_token * m).sum() / (max_len * n_seqs)
    raise ValueError(
        "loss.aggregation must be one of ('token_mean', 'seq_mean_token_mean', "
        f"'seq_mean_token_sum_norm'), got {aggregation!r}"
    )
