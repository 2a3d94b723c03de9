"""The pipeline section of a run's configuration: steps, seeds, checkpoints, shadow runs and
exports."""

from __future__ import annotations

from dataclasses import dataclass

from specroll.drafting.registry import RUN_DRAFTERS
from specroll.rl.config.io import bound, check, one_of

EXPORT_DTYPES = ("float32", "bfloat16")
"""`pipeline.export_dtype` values (and `specroll export --dtype`)."""


STEP_STRIDE = 1_000_003
"""step_seed(base, s) = base * STEP_STRIDE + s (`rl.run.task.step_seed`): distinct (base,
step) pairs never meet."""
REQUESTS_PER_STEP = 100_000
"""Request seeds of step s start at step_seed * this (room for that many rollouts)."""
MAX_STEPS = 1_000_000
"""Most RL steps (`pipeline.steps`): step s of a run draws from seed base * STEP_STRIDE +
s (`rl.run.task.step_seed`), distinct from every other run's steps only while s stays
below STEP_STRIDE."""
MAX_LAG = 64
"""Most steps generated ahead (`pipeline.max_lag`): each one's rollouts wait in memory."""


def max_seed() -> int:
    """The largest `pipeline.seed`: the rollouts of every step derive their seeds from it
    (`rl.run.task`: (seed * STEP_STRIDE + step) * REQUESTS_PER_STEP + i), and each must
    stay below the engine's SEED_LIMIT (2**62, `spec.rng`)."""
    from specroll.spec.rng import SEED_LIMIT

    return SEED_LIMIT // (STEP_STRIDE * REQUESTS_PER_STEP) - 1


@dataclass
class PipelineConfig:
    """The run: length, seed, checkpoints."""

    steps: int = 10
    """RL steps."""
    seed: int = 0
    """Seeds data order, rollouts, and initialisation."""
    out_dir: str = "runs/default"
    """Metrics, checkpoints and the final policy/draft go here."""
    checkpoint_every: int = 5
    """Steps between checkpoints (0 = only at the end and on Ctrl-C)."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept."""
    shadow_every: int = 0
    """Every this many steps, also generate the step's requests without speculation (same
    prompts, seeds and policy version; discarded) to measure the generation speed-up
    (0 = never)."""
    shadow_drafters: tuple[str, ...] = ()
    """At shadow steps, also generate the step's requests with each of these drafters
    (rollout.drafter values made of the run's own drafter's sources, e.g. eagle3 and
    history beside history+eagle3) on the same weights, seeds and history (discarded):
    each one's acceptance and speed-up over plain decoding, measured in one run
    (metrics `shadow/<drafter>/...`; local backend)."""
    max_lag: int = 0
    """Asynchronous RL: rollouts for steps t+1..t+max_lag are generated while the learner
    trains step t (samples up to max_lag updates old; older ones are dropped and counted).
    0 = synchronous. Overlap needs the Ray backend."""
    export_every: int = 0
    """Every this many steps, write a loadable HF export of the policy (and its draft/)
    to out_dir/exports/step-NNNNNN; all are kept (0 = only the final policy/)."""
    export_dtype: str = "float32"
    """Weights of the exports and the final policy/: 'float32' or 'bfloat16'."""

    def __post_init__(self) -> None:
        bound("pipeline", self, "steps", 1)
        check(
            self.steps <= MAX_STEPS,
            f"pipeline.steps must be <= {MAX_STEPS} (each step's seeds must differ from "
            f"every other's), got {self.steps}",
        )
        top = max_seed()
        check(
            0 <= self.seed <= top,
            f"pipeline.seed must be in [0, {top}] (every rollout's seed derives from it and "
            f"must stay below 2**62), got {self.seed}",
        )
        bound("pipeline", self, "max_lag", 0)
        check(
            self.max_lag <= MAX_LAG,
            f"pipeline.max_lag must be <= {MAX_LAG} (each step generated ahead waits in "
            f"memory), got {self.max_lag}",
        )
        bound("pipeline", self, "export_every", 0)
        one_of("pipeline", self, "export_dtype", EXPORT_DTYPES)
        bound("pipeline", self, "checkpoint_every", 0)
        bound("pipeline", self, "keep_checkpoints", 1)
        self.shadow_drafters = tuple(self.shadow_drafters)
        for name in self.shadow_drafters:
            check(
                name in RUN_DRAFTERS,
                f"pipeline.shadow_drafters: {name!r} is not one of {', '.join(RUN_DRAFTERS)}",
            )
