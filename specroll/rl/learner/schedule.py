"""The policy's learning rate at each RL step: warmup, then constant or decaying.

A pure function of the step (and the config), never optimizer-scheduler state: the
trainer computes the rate of step s and hands it to the update, so a run resumed from a
checkpoint trains every step with the rate the uninterrupted run used, on any learner host
(one process, a Ray actor, FSDP ranks) without a scheduler to checkpoint.

Conventions (those of the common LLM fine-tuning recipes, with warmup that never spends
a step at lr 0): step s (0-based) of `warmup_steps` uses lr * (s + 1) / warmup_steps;
after warmup, progress = (s - warmup_steps) / (steps - warmup_steps) runs from 0 towards
1 and the factor is 1 (constant), 1 - progress (linear) or (1 + cos(pi * progress)) / 2
(cosine), scaled into [min_lr_ratio, 1].
"""

from __future__ import annotations

import math

from specroll.rl.config import PolicyConfig


def lr_factor(cfg: PolicyConfig, step: int, steps: int) -> float:
    """The multiplier of `cfg.lr` at RL step `step` (0-based) of a run of `steps` steps."""
    warm = cfg.warmup_steps
    if step < warm:
        return (step + 1) / warm
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warm) / max(1, steps - warm))
    if cfg.lr_schedule == "linear":
        decay = 1.0 - progress
    elif cfg.lr_schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # the config refuses other names; a new one must be added here
        raise ValueError(f"policy.lr_schedule {cfg.lr_schedule!r} has no schedule")
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def lr_at(cfg: PolicyConfig, step: int, steps: int, lr: float | None = None) -> float:
    """The policy's learning rate at RL step `step` (0-based) of `steps`: `lr` (default
    `cfg.lr`; a LoRA run's is lora.lr) under the schedule of `cfg`."""
    return (cfg.lr if lr is None else lr) * lr_factor(cfg, step, steps)
