"""`rollout.backend: local`: specroll's engine in this process, and `build_engine`, the engine
every backend that decodes with specroll's own engine builds where it decodes."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch

from specroll.device import resolve_device, resolve_dtype
from specroll.drafters.trainable import TrainableDraft
from specroll.engine.depth import AdaptiveDepth, FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.profile import cached_profile
from specroll.engine.request import Request
from specroll.model.transformer import Transformer
from specroll.rl.config import RolloutConfig, TrainConfig
from specroll.rl.replica import Weights, replica
from specroll.rl.rollout.base import Done, Pending, RolloutBackend


def place(module: torch.nn.Module, rollout_cfg: RolloutConfig) -> torch.nn.Module:
    """`module` on the rollout side's device and dtype (`rollout.device`, `rollout.dtype`;
    'auto' is resolved where this runs: a Ray worker's own GPU)."""
    return module.to(
        device=resolve_device(rollout_cfg.device, "rollout.device"),
        dtype=resolve_dtype(rollout_cfg.dtype, "rollout.dtype"),
    )


def build_engine(
    rollout_cfg: RolloutConfig,
    model: Transformer,
    draft: TrainableDraft | None,
    prompts: list[list[int]],
    log: Callable[[str], None] = print,
) -> Engine:
    """The engine of a rollout backend on its own `model` and `draft` copies: the depth
    policy of `rollout_cfg`, and for adaptive depth the cost profile of the machine this
    runs on (given, cached, or measured now on `prompts`), so that it is profiled where it
    decodes. Both are moved to `rollout.device` / `rollout.dtype` first."""
    model = place(model, rollout_cfg)
    if draft is not None:
        draft = place(draft, rollout_cfg)
    drafter, depth = None, None
    if draft is not None and rollout_cfg.speculative:
        drafter = draft.drafter()
        if rollout_cfg.depth == "adaptive":
            cost = cached_profile(model, drafter, prompts, rollout_cfg.profile, log)
            depth = AdaptiveDepth(cost, k_max=rollout_cfg.k)
        else:
            depth = FixedDepth(rollout_cfg.k, max_batch=rollout_cfg.spec_max_batch)
    return Engine(model.eval(), EngineConfig(max_batch=rollout_cfg.max_batch), drafter, depth)


class LocalRollout(RolloutBackend):
    """An engine in this process; generation happens inside `submit`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.speculative = engine.drafter is not None
        self._plain: Engine | None = None

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def draft_version(self) -> int | None:
        return self.engine.drafter.version if self.engine.drafter is not None else None

    def submit(self, requests: Sequence[Request], plain: bool = False) -> Pending:
        eng = self.engine
        if plain and eng.drafter is not None:
            if self._plain is None:  # plain decoding on the very same weights
                self._plain = Engine(eng.model, eng.config)
            self._plain.policy_version = eng.policy_version
            eng = self._plain
        return Done(eng.generate(requests))

    def update_weights(self, version: int, weights: Weights) -> None:
        policy, draft = weights.resolve()
        self.engine.load_weights(version, policy, draft if self.speculative else None)


def build(
    cfg: TrainConfig,
    policy: Transformer,
    draft: TrainableDraft | None,
    prompts: list[list[int]],
    log: Callable[[str], None] = print,
) -> LocalRollout:
    """One engine in this process, on copies of the weights (the learner's carry autograd
    state; the engine's are prepacked for inference)."""
    model = copy.deepcopy(policy).eval()
    twin = replica(draft, model) if draft is not None and cfg.rollout.speculative else None
    return LocalRollout(build_engine(cfg.rollout, model, twin, prompts, log))
