"""Rollout backends by name (`rollout.backend`).

A backend is a module with one function,

    build(cfg: TrainConfig, policy: Transformer, draft: TrainableDraft | None,
          prompts: list[list[int]], log: Callable[[str], None]) -> Rollout

that builds whatever decodes (engine replicas, their draft copies, their cost profiles)
where it decodes, from the learner's initial policy and draft; `prompts` are what a
backend measures a hardware profile on. Adding a backend is one module and one entry in
`BACKENDS`. The names are plain strings so that config validation imports nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specroll.drafters.trainable import TrainableDraft
    from specroll.model.transformer import Transformer
    from specroll.rl.config import TrainConfig
    from specroll.rl.rollout import Rollout

BACKENDS: dict[str, str] = {
    "local": "specroll.rl.rollout",
    "ray": "specroll.rl.ray_rollout",
    "vllm": "specroll.rl.vllm_rollout",  # imports vllm only when built (optional extra)
}
"""`rollout.backend` -> the module whose `build` makes it."""


def build_rollout(
    cfg: TrainConfig,
    policy: Transformer,
    draft: TrainableDraft | None,
    prompts: list[list[int]],
    log: Callable[[str], None] = print,
) -> Rollout:
    """The rollout backend `cfg.rollout.backend`, holding copies of `policy` and `draft`
    (version 0: the caller publishes the learner's weights before the first step)."""
    name = cfg.rollout.backend
    if name not in BACKENDS:  # config validation says so first; this guards direct calls
        raise ValueError(f"rollout.backend must be one of {tuple(BACKENDS)}, got {name!r}")
    return importlib.import_module(BACKENDS[name]).build(cfg, policy, draft, prompts, log)
