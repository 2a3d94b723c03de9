"""The draft section of a run's configuration: the draft network's start and online training."""

from __future__ import annotations

from dataclasses import dataclass

from specroll.rl.config.io import bound, check

INITS = ("auto", "offline", "policy", "random")
"""The named starts of `draft.init` (anything else is a draft directory)."""


@dataclass
class DraftConfig:
    """The draft network (`rollout.drafter` names its kind) and its online training."""

    init: str = "auto"
    """'auto' (the cached in-domain draft of this policy if one was built, else a start
    that needs no sampling, trained online from step 1), 'offline' (that in-domain draft,
    built now if missing: minutes), 'policy' (from the policy's own weights), 'random',
    or a draft directory (of the kind rollout.drafter names)."""
    online: bool = True
    """Train the draft every step on the policy forward's detached features."""
    weight: float = 1.0
    """lambda: weight of the draft loss (it has its own optimizer; see learner)."""
    lr: float = 3e-4
    """Draft AdamW learning rate."""
    grad_clip: float = 1.0
    """Gradient-norm clip of the draft update (separate from the policy's)."""
    ttt_steps: int = 3
    """Training-time-test unroll of the online draft loss."""
    step_decay: float = 0.8
    """Weight of unroll step j in the online draft loss is step_decay**j."""
    draft_vocab_size: int = 8192
    """EAGLE-3 draft vocabulary of a draft started without sampling ('policy', 'random')."""

    def __post_init__(self) -> None:
        if self.init == "default":  # its name before 'auto' and 'offline' (issue 47)
            self.init = "offline"
        check(bool(self.init), f"draft.init must be one of {INITS} or a draft directory, got ''")
        bound("draft", self, "weight", 0)
        bound("draft", self, "lr", 0, above=True)
        bound("draft", self, "ttt_steps", 1)
        check(
            0 < self.step_decay <= 1, f"draft.step_decay must be in (0, 1], got {self.step_decay}"
        )
