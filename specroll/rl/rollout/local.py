"""`rollout.backend: local`: specroll's engine in this process, and `build_engine`, the engine
every backend that decodes with specroll's own engine builds where it decodes."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from specroll.device import resolve_device, resolve_dtype
from specroll.drafters.base import Drafter
from specroll.drafting import registry
from specroll.drafting.trainable import TrainableDraft
from specroll.engine.depth import AdaptiveDepth, FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.profile import cached_profile
from specroll.engine.request import Request, Results
from specroll.model import lora
from specroll.model.transformer import Transformer
from specroll.rl.config import TrainConfig
from specroll.rl.config.rollout import RolloutConfig
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
    """The engine of a rollout backend on its own `model` and `draft` copies: the drafter
    and depth policy of `rollout_cfg`, and for adaptive depth the cost profile of the
    machine this runs on (given, cached, or measured now on `prompts`), so that it is
    profiled where it decodes. Both are moved to `rollout.device` / `rollout.dtype` first."""
    model = place(model, rollout_cfg)
    if draft is not None:
        draft = place(draft, rollout_cfg)
    drafter = (
        registry.assemble(rollout_cfg.drafter, None, draft) if rollout_cfg.speculative else None
    )
    return engine_with(rollout_cfg, model.eval(), drafter, prompts, log)


def engine_with(
    rollout_cfg: RolloutConfig,
    model: Transformer,
    drafter: Drafter | None,
    prompts: list[list[int]],
    log: Callable[[str], None] = print,
) -> Engine:
    """An engine of `model` drafting with `drafter` under the depth policy of
    `rollout_cfg` (adaptive: the cost profile of this machine for that drafter)."""
    depth = None
    if drafter is not None:
        k = rollout_cfg.k_max_for(drafter.tree)
        if rollout_cfg.depth == "adaptive":
            cost = cached_profile(model, drafter, prompts, rollout_cfg.profile, log)
            depth = AdaptiveDepth(cost, k_max=k, tree=drafter.tree)
        else:
            depth = FixedDepth(k, max_batch=rollout_cfg.spec_max_batch)
    config = EngineConfig(max_batch=rollout_cfg.max_batch, cuda_graphs=rollout_cfg.cuda_graphs)
    return Engine(model, config, drafter, depth)


class LocalRollout(RolloutBackend):
    """An engine in this process; generation happens inside `submit`."""

    def __init__(
        self,
        engine: Engine,
        rollout_cfg: RolloutConfig | None = None,
        prompts: list[list[int]] | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.engine = engine
        self._alt: dict[str, Engine] = {}
        self._alt_args = (rollout_cfg, prompts or [], log)
        self.speculative = engine.drafter is not None
        self._draft_weights = self.speculative and engine.drafter.network is not None
        self._plain: Engine | None = None
        self.served: lora.Served | None = None
        """How the engine takes a LoRA policy's refits (adapters only), or None."""

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def draft_version(self) -> int | None:
        return self.engine.drafter.version if self.engine.drafter is not None else None

    def submit(self, requests: Sequence[Request]) -> Pending:
        return Done(self.engine.generate(requests))

    def generate_plain(self, requests: Sequence[Request]) -> Results:
        """`requests` decoded without the drafter, on the very same weights (`PlainShadow`)."""
        eng = self.engine
        if eng.drafter is not None:
            if self._plain is None:
                self._plain = Engine(eng.model, eng.config)
            self._plain.policy_version = eng.policy_version
            eng = self._plain
        return eng.generate(requests)

    def update_weights(self, version: int, weights: Weights) -> None:
        policy, draft = weights.resolve()
        if self.served is not None:
            policy = self.served.state(policy)
        draft = draft if self._draft_weights else None
        self.engine.load_weights(version, policy, draft, partial=self.served is not None)

    def drafter_snapshot(self) -> dict | None:
        """The history store now (`DrafterShadow`): taken before a step's rollouts join it,
        what that step's shadow drafters start from."""
        history = registry.history_of(self.engine.drafter)
        return history.state_dict() if history is not None else None

    @contextmanager
    def alternative(
        self, name: str, before: dict | None
    ) -> Iterator[Callable[[Sequence[Request]], Results]]:
        """Generate with the drafter `name` (a `rollout.drafter` value) made of this
        engine's drafter's parts — its history, its draft network — on the same weights
        (`DrafterShadow`; `pipeline.shadow_drafters`). Its engine is built (and, for
        adaptive depth, its drafter profiled) on first use, when entering. A drafter that
        drafts from history starts from the store as it was before the step (`before`,
        from `drafter_snapshot`) and learns from its own rollouts as the run's drafter did
        from its; the run's store is put back on exit. Drafting from a store that already
        holds the step's rollouts — the same requests and seeds — would copy them.
        Without `before` the store is held fixed instead."""
        eng = self._alt.get(name)
        if eng is None:
            rollout_cfg, prompts, log = self._alt_args
            part = registry.part_of(self.engine.drafter, name)
            eng = self._alt[name] = engine_with(rollout_cfg, self.engine.model, part, prompts, log)

        def generate(requests: Sequence[Request]) -> Results:
            eng.policy_version = self.engine.policy_version
            return eng.generate(requests)

        history = registry.history_of(self.engine.drafter)
        if history is None or "history" not in registry.sources(name):
            yield generate
            return
        learn, now = history.learn, history.state_dict() if before is not None else None
        if before is not None:
            history.load_state_dict(before)
        history.learn = before is not None
        try:
            yield generate
        finally:
            history.learn = learn
            if now is not None:
                history.load_state_dict(now)

    def drafter_state(self) -> dict | None:
        """The drafter's state (a history store), and what the depth policy learnt: for a
        drafter with forms its figures of them (`engine.forms`), for adaptive depth its
        acceptance, time calibration and cost model (`AdaptiveDepth.state_dict`)."""
        d = self.engine.drafter
        if d is None:
            return None
        state = d.state_dict() if hasattr(d, "state_dict") else {}
        if d.forms:
            state["forms"] = self.engine.depth.forms.state_dict()
        if hasattr(self.engine.depth, "state_dict"):
            state["depth"] = self.engine.depth.state_dict()
        return state or None

    def load_drafter_state(self, state: dict) -> None:
        d = self.engine.drafter
        if "depth" in state and hasattr(self.engine.depth, "load_state_dict"):
            self.engine.depth.load_state_dict(state["depth"])
        state = {k: v for k, v in state.items() if k != "depth"}
        if hasattr(d, "load_state_dict"):
            d.load_state_dict(state)
        if d.forms:  # (a checkpoint from before the forms moved kept them in the drafter's)
            forms = state.get("forms", state if "network" in state else None)
            if forms is not None:
                self.engine.depth.forms.load_state_dict(forms)


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
    served = None
    if model.lora_spec is not None:  # before the engine profiles it: merged has no adapters
        served = lora.Served(model, merged=cfg.lora.serve == "merged")
    uses = draft is not None and cfg.rollout.speculative and cfg.rollout.network
    twin = replica(draft, model) if uses else None
    engine = build_engine(cfg.rollout, model, twin, prompts, log)
    backend = LocalRollout(engine, cfg.rollout, prompts, log)
    if served is not None:
        served.device = next(engine.model.parameters()).device  # merge where it decodes
    backend.served = served
    return backend
