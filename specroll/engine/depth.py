"""Speculation depth: how many draft tokens per row this iteration (0 = plain decoding).

On CPUs (and on GPUs past a few hundred tokens per device) a large batch is compute
bound and verifying k+1 tokens costs close to (k+1)x, so speculation pays in small
batches — such as the long tail of a rollout — and loses in large ones. The policy sees
the live batch size every iteration.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FixedDepth:
    """k draft tokens while the active batch is at most `max_batch`, else plain decoding."""

    k: int = 3
    """Draft tokens per row per iteration."""
    max_batch: int = 1 << 30
    """Largest active batch that still speculates."""

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")
        if self.max_batch < 0:
            raise ValueError(f"max_batch must be >= 0, got {self.max_batch}")

    @property
    def k_max(self) -> int:
        return self.k

    def choose(self, batch_size: int) -> int:
        return self.k if batch_size <= self.max_batch else 0
