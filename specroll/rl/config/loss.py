"""The loss section of a run's configuration: the GRPO / DAPO objective and its batch."""

from __future__ import annotations

from dataclasses import dataclass

from specroll.rl.config.io import bound, check, one_of

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
"""`loss.aggregation` values (`rl.algo.loss.micro_share`)."""
KL_ESTIMATORS = ("k1", "k2", "k3")
"""`loss.kl_estimator` values (`rl.algo.loss.kl_estimate`)."""


MAX_REFILL_ROUNDS = 64
"""Most extra generation rounds per step (`loss.max_refill_rounds`)."""


@dataclass
class LossConfig:
    """GRPO / DAPO objective (see rl.algo.loss)."""

    clip_low: float = 0.2
    """Lower clip range: ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """Upper clip range (DAPO clip-higher): ratio <= 1 + clip_high."""
    aggregation: str = "token_mean"
    """How token losses make the loss: 'token_mean' (DAPO: every token of the update
    weighs the same), 'seq_mean_token_mean' (GRPO: mean per sequence, then over
    sequences) or 'seq_mean_token_sum_norm' (Dr. GRPO: sum per sequence divided by the
    constant rollout.max_new_tokens, then mean over sequences). Replaces token_level."""
    drop_uniform_groups: bool = True
    """Drop groups whose rewards are all equal (DAPO dynamic sampling)."""
    max_refill_rounds: int = 0
    """Dynamic sampling with refill (needs drop_uniform_groups): up to this many extra
    rounds of prompts_per_step fresh prompts per step, until prompts_per_step informative
    groups are kept (the first ones, in draw order); 0 = drop without refill."""
    mask_truncated: bool = False
    """Overlong filtering: responses cut by the budget (max_new_tokens or the context
    window) contribute no loss (they still count in their group's advantages)."""
    overlong_buffer: int = 0
    """Soft overlong penalty over the last this-many tokens of the budget (0 = off)."""
    kl_coef: float = 0.0
    """KL penalty to the initial policy (estimator: kl_estimator); 0 = off (no reference
    copy)."""
    kl_estimator: str = "k3"
    """Per-token estimate of KL(pi || ref) from log r = log ref - log pi: 'k1' (-log r),
    'k2' ((log r)^2 / 2) or 'k3' (r - 1 - log r; Schulman 2020)."""
    scale_advantages: bool = True
    """Divide advantages by the group std (GRPO); False = mean-centred only."""
    updates_per_step: int = 1
    """Optimizer steps per RL step (the batch is split; >1 makes the clip matter)."""
    behaviour_weight_cap: float = 2.0
    """Async (pipeline.max_lag > 0): cap of the decoupled-PPO importance weight
    pi_prox / pi_behaviour that corrects for samples drawn by an older policy."""
    tis_cap: float = 0.0
    """Truncated importance sampling of the rollout-learner mismatch: weight each token's
    loss by min(pi_learner / pi_engine, tis_cap) (bf16 or GPU engines sample from a
    slightly different distribution than the learner scores); 0 = off."""

    def __post_init__(self) -> None:
        check(0 <= self.clip_low < 1, f"loss.clip_low must be in [0, 1), got {self.clip_low}")
        bound("loss", self, "clip_high", 0)
        bound("loss", self, "overlong_buffer", 0)
        bound("loss", self, "kl_coef", 0)
        bound("loss", self, "updates_per_step", 1)
        check(
            self.tis_cap == 0 or self.tis_cap >= 1,
            f"loss.tis_cap must be 0 (off) or >= 1, got {self.tis_cap}",
        )
        one_of("loss", self, "aggregation", AGGREGATIONS)
        one_of("loss", self, "kl_estimator", KL_ESTIMATORS)
        bound("loss", self, "max_refill_rounds", 0)
        check(
            self.max_refill_rounds <= MAX_REFILL_ROUNDS,
            f"loss.max_refill_rounds must be <= {MAX_REFILL_ROUNDS}, got {self.max_refill_rounds}",
        )
        check(
            self.max_refill_rounds == 0 or self.drop_uniform_groups,
            f"loss.max_refill_rounds={self.max_refill_rounds} refills dropped groups: it "
            "needs loss.drop_uniform_groups=true",
        )
