"""A step's advantages: its rewards shaped, normalised per group, and the groups it
trains on, as pure tensor functions (what the step's reward stage computes, and each
dynamic-sampling refill round again over all its groups).

GRPO (DeepSeekMath, arXiv 2402.03300): G samples per prompt, advantage = reward minus the
group mean, divided by the group std; Dr. GRPO (arXiv 2503.20783) drops the std scaling.
DAPO (arXiv 2503.14476): groups whose rewards are all equal carry zero advantage, pure
noise in the batch, and may be left out; a soft penalty shapes the rewards of responses
that run into the length limit. Shapes: rewards [P, G] (group-major).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specroll.engine.request import Results
    from specroll.rl.config import LossConfig


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """[P, G] rewards → [P, G] advantages: (r - mean_g) / (std_g + eps) (std unbiased=False);
    scale=False keeps only the mean subtraction (Dr. GRPO)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[P] True where a group's rewards are not all equal (DAPO dynamic sampling)."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to max_len - buffer, then linear down to -1 at
    max_len (lengths in tokens)."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0) / buffer
    return -over.clamp(max=1.0)


def step_advantages(
    rewards: torch.Tensor, lengths: torch.Tensor, max_new_tokens: int, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's advantages and the groups it trains on.

    rewards: [P, G]; lengths: [P * G] response lengths (group-major). The rewards are
    shaped by the overlong penalty, then normalised per group; with
    `drop_uniform_groups`, groups whose shaped rewards are all equal are left out.
    Returns (advantages [P, G], keep [P] bool)."""
    penalty = overlong_penalty(lengths, max_new_tokens, cfg.overlong_buffer)
    shaped = rewards + penalty.view_as(rewards)
    adv = group_advantages(shaped, scale=cfg.scale_advantages)
    if cfg.drop_uniform_groups:
        return adv, informative_groups(shaped)
    return adv, torch.ones(rewards.shape[0], dtype=torch.bool, device=rewards.device)


def result_advantages(
    rewards: torch.Tensor, results: Results, max_new_tokens: int, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [P, G], informative [P] bool) of `rewards` [P, G] and their rollouts
    (`step_advantages` on the results' response lengths)."""
    lengths = torch.tensor([len(r.token_ids) for r in results], device="cpu")
    return step_advantages(rewards, lengths, max_new_tokens, cfg)
