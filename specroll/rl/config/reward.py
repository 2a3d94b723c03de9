"""The reward section of a run's configuration: how completions are rewarded."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specroll.rl.config.io import bound, check
from specroll.tasks import reward_refs, reward_worker
from specroll.tasks.reward import NEEDS_ANSWER


@dataclass
class RewardConfig:
    """What a completion earns: built-in or user reward functions, weighted and summed
    (README: "Train on your own data"; the signature: `tasks.rewards`)."""

    functions: tuple[str, ...] = ("math",)
    """Built-ins (math, exact_match, format) or 'path/to/file.py:fn' / 'package.module:fn'
    with fn(prompt, completion, record) -> float | dict[str, float]. A value (and each
    component) must be finite and within +-1e6; a dict holds at most 32 components named
    like identifiers ([A-Za-z_][A-Za-z0-9_.-]*, up to 32 characters). All of them run in
    one worker process with at most 8 GiB of address space."""
    weights: tuple[float, ...] = ()
    """One weight per function (() = all 1), each within +-1e6."""
    timeout_s: float = 30.0
    """Seconds a function (built-in or yours) may take on one completion before the step
    fails (at most 3600); importing a reward module may take this, and at least 30 s."""

    def __post_init__(self) -> None:
        self.functions = tuple(self.functions)
        self.weights = tuple(float(w) for w in self.weights)
        reward_refs.check(self.functions)  # before any model loads; runs no user code
        check(
            not self.weights or len(self.weights) == len(self.functions),
            f"reward.weights must give one weight per reward.functions entry "
            f"({len(self.functions)}), got {len(self.weights)}",
        )
        check(
            all(math.isfinite(w) and abs(w) <= reward_refs.MAX_REWARD for w in self.weights),
            f"reward.weights must be finite numbers within +-{reward_refs.MAX_REWARD:g}, got "
            f"{list(self.weights)}",
        )
        bound("reward", self, "timeout_s", 0, above=True)
        check(
            self.timeout_s <= reward_worker.MAX_TIMEOUT_S,
            f"reward.timeout_s must be at most {reward_worker.MAX_TIMEOUT_S:g} (seconds per "
            f"completion), got {self.timeout_s}",
        )

    @property
    def needs_answers(self) -> bool:
        """Whether a built-in compares with the records' answers (so each needs one)."""
        return any(f in NEEDS_ANSWER for f in self.functions)
