"""Where rollouts are generated, behind one interface (one loop, any placement).

* `submit(requests)` hands a step's requests to the rollout side and returns a
  `Pending`; `Pending.result()` waits for them and gives the results in request order
  with the merged speculation counters. In-process generation runs at submit time; on
  Ray it runs on the workers while the learner goes on (asynchronous RL).
* `publish(version, policy_state, draft_state)` makes new weights (tensors by name)
  available under a version (stage `prepare`); every result records the versions it was
  generated with.

Backends are chosen by name (`rollout.backend`, `specroll.rl.backends`); this module is
the in-process one (`local`) and holds `build_engine`, the engine every backend that
decodes with specroll's own engine builds where it decodes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch

from specroll.device import resolve_device, resolve_dtype
from specroll.drafters.trainable import TrainableDraft, replica
from specroll.engine.depth import AdaptiveDepth, FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.request import Request, Result
from specroll.model.transformer import Transformer
from specroll.rl.config import RolloutConfig, TrainConfig
from specroll.spec.metrics import SpecStats

State = dict[str, torch.Tensor]
"""A module's tensors by name: what weight publishing carries."""


def state(module: torch.nn.Module | None) -> State | None:
    """A module's tensors by name, detached (views, not copies): what `publish` takes."""
    if module is None:
        return None
    return {k: v.detach() for k, v in module.state_dict().items()}


class Pending:
    """Requests handed to the rollout side; `result()` blocks until they are done."""

    def result(self) -> tuple[list[Result], SpecStats]:
        raise NotImplementedError


class Done(Pending):
    def __init__(self, results: list[Result], stats: SpecStats) -> None:
        self._out = (results, stats)

    def result(self) -> tuple[list[Result], SpecStats]:
        return self._out


class Rollout:
    """Generation backend: submit requests, publish weights."""

    restarts: int = 0
    """Rollout workers restarted after a failure (their requests were re-queued)."""
    speculative: bool = False
    """Whether rollouts are drafted (results then carry a draft version)."""

    def submit(self, requests: Sequence[Request], plain: bool = False) -> Pending:
        """Generate `requests` with the latest published weights (plain: no drafter)."""
        raise NotImplementedError

    def generate(self, requests: Sequence[Request], plain: bool = False):
        return self.submit(requests, plain).result()

    def publish(self, version: int, policy: State, draft: State | None) -> None:
        """Load new weights under `version` (draft: None keeps the draft's)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def place(module: torch.nn.Module, rc: RolloutConfig) -> torch.nn.Module:
    """`module` on the rollout side's device and dtype (`rollout.device`, `rollout.dtype`;
    'auto' is resolved where this runs: a Ray worker's own GPU)."""
    return module.to(
        device=resolve_device(rc.device, "rollout.device"),
        dtype=resolve_dtype(rc.dtype, "rollout.dtype"),
    )


def build_engine(
    rc: RolloutConfig,
    model: Transformer,
    draft: TrainableDraft | None,
    prompts: list[list[int]],
    log: Callable[[str], None] = print,
) -> Engine:
    """The engine of a rollout backend on its own `model` and `draft` copies: the depth
    policy of `rc`, and for adaptive depth the cost profile of the machine this runs on
    (given, cached, or measured now on `prompts`), so that it is profiled where it decodes.
    Both are moved to `rollout.device` / `rollout.dtype` first."""
    model = place(model, rc)
    if draft is not None:
        draft = place(draft, rc)
    drafter, depth = None, None
    if draft is not None and rc.speculative:
        drafter = draft.drafter()
        if rc.depth == "adaptive":
            from specroll.engine.profile import cached_profile

            cost = cached_profile(model, drafter, prompts, rc.profile, log)
            depth = AdaptiveDepth(cost, k_max=rc.k)
        else:
            depth = FixedDepth(rc.k, max_batch=rc.spec_max_batch)
    return Engine(model.eval(), EngineConfig(max_batch=rc.max_batch), drafter, depth)


class LocalRollout(Rollout):
    """The engine in this process; generation happens inside `submit`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.speculative = engine.drafter is not None
        self._plain: Engine | None = None

    def submit(self, requests: Sequence[Request], plain: bool = False) -> Pending:
        eng = self.engine
        if plain and eng.drafter is not None:
            if self._plain is None:  # plain decoding on the very same weights
                self._plain = Engine(eng.model, eng.config)
            self._plain.policy_version = eng.policy_version
            eng = self._plain
        out = eng.generate(requests)
        return Done(out, out.stats)

    def publish(self, version: int, policy: State, draft: State | None) -> None:
        self.engine.load_weights(version, policy, draft if self.speculative else None)


def build(
    cfg: TrainConfig,
    policy: Transformer,
    draft: TrainableDraft | None,
    prompts: list[list[int]],
    log: Callable[[str], None] = print,
) -> LocalRollout:
    """`rollout.backend: local`: one engine in this process, on copies of the weights
    (the learner's carry autograd state; the engine's are prepacked for inference)."""
    model = copy.deepcopy(policy).eval()
    twin = replica(draft, model) if draft is not None and cfg.rollout.speculative else None
    return LocalRollout(build_engine(cfg.rollout, model, twin, prompts, log))
