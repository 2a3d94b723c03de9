"""Weight sync (stage `prepare`): learner → rollout engine, versioned.

After every update the learner publishes its policy and draft weights with `version` =
the learner step. A backend receives them; the engine stamps every result with the
versions it generated with, and the pipeline asserts those are the ones it expects (in
synchronous mode, the latest). Backends publish through `Rollout.publish`
(`rl/rollout.py`); `LocalSync` is what an engine in the same process (the driver's, or
a Ray worker's) uses: the engine owns its own copy of the weights (the learner's are
being differentiated; the engine's are prepacked for inference), and publishing copies
tensors in place.
"""

from __future__ import annotations

import torch
from torch import nn

from specroll.engine.engine import Engine


def _copy_into(dst: nn.Module, src: nn.Module | dict, what: str) -> None:
    """Copy src's state (a module or a state dict) into dst in place; refuse any
    shape/name mismatch loudly."""
    s, d = (src if isinstance(src, dict) else src.state_dict()), dst.state_dict()
    if s.keys() != d.keys():
        raise ValueError(
            f"{what} weights do not match the engine's: names differ "
            f"({sorted(set(s) ^ set(d))[:5]})"
        )
    for name, t in s.items():
        if t.shape != d[name].shape:
            raise ValueError(
                f"{what} tensor {name} has shape {tuple(t.shape)}, "
                f"the engine's {tuple(d[name].shape)}"
            )
    with torch.no_grad():
        for name, t in s.items():
            d[name].copy_(t)


def state(module: nn.Module | None) -> dict | None:
    """A module's tensors, detached, for shipping to another process (Ray object store)."""
    if module is None:
        return None
    return {k: v.detach() for k, v in module.state_dict().items()}


class LocalSync:
    """In-process sync into an engine's own model (and its drafter's network)."""

    def __init__(self, engine: Engine, engine_draft: nn.Module | None = None) -> None:
        self.engine = engine
        self.engine_draft = engine_draft

    def publish(
        self, version: int, policy: nn.Module | dict, draft: nn.Module | dict | None
    ) -> None:
        _copy_into(self.engine.model, policy, "policy")
        self.engine.policy_version = version
        if draft is not None and self.engine_draft is not None:
            _copy_into(self.engine_draft, draft, "draft")
            self.engine.drafter.version = version
        self.engine.warm()  # repacking is part of the weight sync (stage `prepare`)
