"""The policy section of a run's configuration: the model and its optimizer."""

from __future__ import annotations

from dataclasses import dataclass

from specroll.rl.config.io import bound, check, one_of

LR_SCHEDULES = ("constant", "linear", "cosine")
"""`policy.lr_schedule` values."""


@dataclass
class PolicyConfig:
    """The policy and its optimizer."""

    model: str = "smollm2"
    """Policy: 'smollm2' (embedded default), 'tiny' (random tiny model), HF dir or .gguf."""
    lr: float = 5e-6
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip of the policy update."""
    micro_batch: int = 16
    """Most sequences per learner forward (gradients accumulate over micro-batches; fewer
    where that saves more padding than a forward costs: `rl.algo.batch.plan_micro_batches`)."""
    warmup_steps: int = 0
    """Linear learning-rate warmup over the first this-many RL steps (0 = none)."""
    lr_schedule: str = "constant"
    """After warmup: 'constant', or 'linear' / 'cosine' decay towards min_lr_ratio * lr
    over the remaining pipeline.steps (a pure function of the step: `learner.schedule`)."""
    min_lr_ratio: float = 0.0
    """lr_schedule 'linear' / 'cosine': the floor of the decay, as a fraction of lr."""

    def __post_init__(self) -> None:
        bound("policy", self, "lr", 0, above=True)
        bound("policy", self, "grad_clip", 0, above=True)
        bound("policy", self, "micro_batch", 1)
        bound("policy", self, "warmup_steps", 0)
        one_of("policy", self, "lr_schedule", LR_SCHEDULES)
        check(
            0 <= self.min_lr_ratio <= 1,
            f"policy.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}",
        )
        check(
            self.min_lr_ratio == 0 or self.lr_schedule != "constant",
            f"policy.min_lr_ratio={self.min_lr_ratio} needs policy.lr_schedule 'linear' or "
            "'cosine' (a constant schedule does not decay)",
        )
