"""Rollout backends: where rollouts are generated, behind one interface (`base`).

`rollout.backend` names one of `BACKENDS`; each is a module with one function,

    build(cfg: TrainConfig, policy: Transformer, draft: TrainableDraft | None,
          prompts: list[list[int]], log: Callable[[str], None]) -> RolloutBackend

that builds whatever decodes (engine replicas, their draft copies, their cost profiles)
where it decodes, from the learner's initial policy and draft; `prompts` are what a
backend measures a hardware profile on (`profile_prompts`: fixed, so that a cached
profile serves every run). Adding a backend is one module and one entry in
`BACKENDS` (and its name in `rl.config.rollout.ROLLOUT_BACKENDS`, which validates the setting
without importing any backend). Modules are imported when built: `vllm` and `ray` are
optional extras.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from specroll.drafting.trainable import TrainableDraft
from specroll.engine.profile import PROFILE_PROMPTS_SEED
from specroll.model.transformer import Transformer
from specroll.rl.config import TrainConfig
from specroll.rl.config.rollout import ROLLOUT_BACKENDS
from specroll.rl.rollout.base import Done, Pending, RolloutBackend
from specroll.tasks.sets import encode, math_problems

__all__ = [
    "BACKENDS",
    "Done",
    "Pending",
    "RolloutBackend",
    "build_backend",
    "build_rollout",
    "profile_prompts",
]

BACKENDS: dict[str, str] = {
    "local": "specroll.rl.rollout.local",
    "ray": "specroll.rl.rollout.ray",
    "vllm": "specroll.rl.rollout.vllm",
}
"""`rollout.backend` -> the module whose `build` makes it."""
assert tuple(BACKENDS) == ROLLOUT_BACKENDS, "rl.config.rollout.ROLLOUT_BACKENDS is out of date"


def profile_prompts(tok) -> list[list[int]]:
    """The prompts a backend measures its hardware profile on (adaptive depth)."""
    return [encode(tok, p) for p in math_problems(8, seed=PROFILE_PROMPTS_SEED)]


def build_rollout(
    cfg: TrainConfig,
    policy: Transformer,
    draft: TrainableDraft | None,
    tok,
    log: Callable[[str], None] = print,
) -> RolloutBackend:
    """The rollout backend `cfg.rollout.backend`, holding copies of `policy` and `draft`
    (version 0: the caller publishes the learner's weights before the first step)."""
    return build_backend(cfg, policy, draft, profile_prompts(tok), log)


def build_backend(
    cfg: TrainConfig,
    policy: Transformer,
    draft: TrainableDraft | None,
    prompts: list[list[int]],
    log: Callable[[str], None] = print,
) -> RolloutBackend:
    """`build_rollout` with the profiling prompts given (a Ray worker gets the driver's)."""
    name = cfg.rollout.backend
    if name not in BACKENDS:  # config validation says so first; this guards direct calls
        raise ValueError(f"rollout.backend must be one of {tuple(BACKENDS)}, got {name!r}")
    module = importlib.import_module(BACKENDS[name])
    return module.build(cfg, policy, draft, prompts, log)
