"""The learner section of a run's configuration: where and how the update runs."""

from __future__ import annotations

from dataclasses import dataclass

from specroll.device import check_device_name, check_dtype_name
from specroll.rl.config.io import bound, check, one_of

RECOMPUTE = ("auto", "always")
"""`learner.recompute_logprobs` values."""
STRATEGIES = ("single", "fsdp")
"""`learner.strategy` values."""
PLACEMENTS = ("auto", "local", "ray")
"""`learner.placement` values."""


@dataclass
class LearnerConfig:
    """Where and how the learner computes (the optimizer itself: section `policy`)."""

    device: str = "auto"
    """Where the learner trains: 'auto' (CUDA when present, else CPU), 'cpu', 'cuda[:N]'."""
    dtype: str = "float32"
    """Compute dtype: 'float32', 'bfloat16' (autocast over fp32 master weights and fp32
    optimizer state; log-softmax and the loss in fp32), or 'auto': bfloat16 where this
    machine's bf16 products measure clearly faster than fp32 (`specroll.capability`),
    else float32 (the default preset's choice)."""
    recompute_logprobs: str = "auto"
    """Stage `logprob`: 'always' recomputes the old log-probs with the learner; 'auto'
    uses the engine's (equal to float rounding when both sides are fp32 and the samples
    are on-policy), checking them against a recomputation on the first step and every
    `check_every` steps, and recomputing from then on if a check fails."""
    check_every: int = 10
    """recompute_logprobs='auto': steps between agreement checks (the first step is one)."""
    strategy: str = "single"
    """'single' (one process) or 'fsdp' (`ranks` processes, FSDP2-sharded policy)."""
    ranks: int = 1
    """Learner ranks (data-parallel, one process group); more than 1 needs strategy 'fsdp'."""
    placement: str = "auto"
    """Where the learner runs: 'local' (this process, or local processes for FSDP ranks),
    'ray' (Ray actors: weights then go from the learner to Ray rollout workers without
    passing through this process), or 'auto' (ray when rollout.backend is ray)."""

    def __post_init__(self) -> None:
        one_of("learner", self, "strategy", STRATEGIES)
        check(
            isinstance(self.ranks, int) and self.ranks >= 1,
            f"learner.ranks must be an integer >= 1, got {self.ranks!r}",
        )
        check(
            self.ranks <= 1024,
            f"learner.ranks must be <= 1024 (each rank is a process with its own "
            f"activations), got {self.ranks}",
        )
        check(
            self.ranks == 1 or self.strategy == "fsdp",
            f"learner.ranks={self.ranks} needs learner.strategy=fsdp (single is one process)",
        )
        one_of("learner", self, "placement", PLACEMENTS)
        check_device_name("learner.device", self.device)
        if self.dtype != "auto":
            check_dtype_name("learner.dtype", self.dtype, extra=("auto",))
        one_of("learner", self, "recompute_logprobs", RECOMPUTE)
        bound("learner", self, "check_every", 1)
