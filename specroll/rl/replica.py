"""What crosses between the learner and the rollout side: weights by name, the handle a
weight update travels in, and the spec that rebuilds the policy and its draft elsewhere.

The learner owns the trained modules; every rollout backend decodes with copies of them
(its own tensors, prepacked for inference, possibly in another process or on another
machine). A weight update is a `Weights` handle: the tensors themselves (`remote=False`)
or Ray object references to them (`remote=True`, put into the object store by a learner
actor, so the driver never holds a copy). A `ReplicaSpec` (model config, draft class and
config: all picklable) rebuilds the modules those tensors load into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specroll.drafting.trainable import TrainableDraft
from specroll.model import lora
from specroll.model.config import ModelConfig
from specroll.model.transformer import Transformer

State = dict[str, torch.Tensor]
"""A module's tensors by name."""


def tensors_of(module: torch.nn.Module | None) -> State | None:
    """A module's tensors by name, detached (views, not copies); None for no module."""
    if module is None:
        return None
    return {k: v.detach() for k, v in module.state_dict().items()}


def to_cpu(tree: Any) -> Any:
    """Every tensor of a nested dict / list / tuple on the CPU (tensors there already are
    returned as they are, not copied)."""
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree


@dataclass(frozen=True)
class Weights:
    """One published set of weights: the policy's tensors and the draft's (None keeps the
    draft a backend holds), here or in Ray's object store."""

    policy: Any
    """The policy's `State`, or (remote) an object reference to one."""
    draft: Any = None
    """The draft's `State` or None, or (remote) an object reference to either."""
    remote: bool = False
    """Whether `policy` and `draft` are Ray object references."""

    @classmethod
    def of(cls, policy: Transformer, draft: torch.nn.Module | None) -> Weights:
        """The modules' tensors (views: a backend copies them into its own); of a LoRA
        policy only its adapters (the rollout side keeps the base it was built with)."""
        if policy.lora_spec is not None:
            return cls(lora.adapters(policy), tensors_of(draft))
        return cls(tensors_of(policy), tensors_of(draft))

    def resolve(self) -> tuple[State, State | None]:
        """(policy, draft) tensors here (fetched from the object store when remote)."""
        if not self.remote:
            return self.policy, self.draft
        import ray

        if self.draft is None:
            return ray.get(self.policy), None
        policy, draft = ray.get([self.policy, self.draft])
        return policy, draft

    def put(self) -> Weights:
        """The same weights in Ray's object store (itself when they are there already)."""
        if self.remote:
            return self
        import ray

        draft = None if self.draft is None else ray.put(self.draft)
        return Weights(ray.put(self.policy), draft, remote=True)


@dataclass(frozen=True)
class ReplicaSpec:
    """The shapes of a policy and its draft, without their weights: what another process
    needs to rebuild them (`build`) before loading shipped tensors."""

    model: ModelConfig
    """The policy's architecture."""
    draft_cls: type | None = None
    """The draft's class (a `TrainableDraft`), or None without a draft."""
    draft_cfg: Any = None
    """The draft's architecture (`draft.cfg`)."""
    lora: lora.LoraSpec | None = None
    """The policy's adapters (a LoRA policy), or None."""

    @classmethod
    def of(cls, policy: Transformer, draft: TrainableDraft | None = None) -> ReplicaSpec:
        if draft is None:
            return cls(policy.cfg, lora=policy.lora_spec)
        return cls(policy.cfg, type(draft), draft.cfg, policy.lora_spec)

    @property
    def has_draft(self) -> bool:
        return self.draft_cls is not None

    def policy(self, state: State | None = None) -> Transformer:
        """A policy of this shape (with its adapters, base frozen) holding `state` (or its
        random initial weights)."""
        model = Transformer(self.model)
        if self.lora is not None:
            lora.attach(model, self.lora)
        if state is not None:
            model.load_state_dict(state)
        return model

    def draft(self, policy: Transformer, state: State | None = None) -> TrainableDraft | None:
        """The draft on top of `policy` (it references the policy's embedding, and for MTP
        its head) holding `state`; None without a draft."""
        if self.draft_cls is None:
            return None
        draft = self.draft_cls(self.draft_cfg, policy)
        if state is not None:
            draft.load_state_dict(state)
        return draft

    def build(
        self, policy: State | None = None, draft: State | None = None
    ) -> tuple[Transformer, TrainableDraft | None]:
        """(policy, draft) of this shape holding the given tensors."""
        model = self.policy(policy)
        return model, self.draft(model, draft)


def replica(draft: TrainableDraft, policy: Transformer) -> TrainableDraft:
    """A copy of `draft` (same weights, its own tensors) on top of `policy`: the engine's
    copy of the learner's draft."""
    return ReplicaSpec.of(policy, draft).draft(policy, draft.state_dict()).eval()
