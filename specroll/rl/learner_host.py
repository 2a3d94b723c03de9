"""Where the learner runs: in the driver process, or in a Ray actor.

The pipeline asks the same five things of either (one loop, two placements): the
log-probs of a batch (policy and reference), an update, the weights to publish, the
training state for a checkpoint (and its restore), and an export of the trained models.

`LocalLearnerHost` keeps the policy and draft objects the caller built (moved to
`learner.device`). `RayLearnerHost` moves them into a `LearnerActor` (CPUs / GPUs from
`ray.learner_cpus` / `learner_gpus`; `learner.device: auto` there is the GPU Ray gave the
actor, else its CPU) and publishes weights straight from the actor into the object store:
rollout workers read them there, the driver never holds a copy.

Devices at the seams: batches and old log-probs arrive on the CPU (the learner moves
them), log-probs leave on the CPU, `weights()` may be on the learner's device (the
rollout side copies them into its own tensors), and `state()` is on the CPU, so that a
checkpoint written by a GPU learner loads on a machine without one (`restore` copies
every tensor back onto the learner's device).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path

import torch

from specroll.device import resolve_device, resolve_dtype
from specroll.drafters.trainable import TrainableDraft
from specroll.model.transformer import Transformer
from specroll.rl.batch import Batch
from specroll.rl.config import TrainConfig
from specroll.rl.learner import Learner
from specroll.rl.rollout import State, state


def build_learner(
    cfg: TrainConfig,
    policy: Transformer,
    draft: TrainableDraft | None,
    device: torch.device | None = None,
    prepare: Callable[[Transformer], None] | None = None,
) -> Learner:
    """The Learner of a run: policy (+ reference copy when KL is on) + online draft, on
    `device` (default: `learner.device`, resolved here) in `learner.dtype`.

    prepare: applied to the policy and the reference before the optimizer is made (an
    FSDP rank shards them there: the optimizer must step the shards)."""
    if device is None:
        device = resolve_device(cfg.learner.device, "learner.device")
    reference = None
    if cfg.loss.kl_coef > 0:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if prepare is not None:
        for model in (reference, policy):
            if model is not None:
                prepare(model)
    return Learner(
        policy,
        policy_cfg=cfg.policy,
        loss_cfg=cfg.loss,
        rollout_cfg=cfg.rollout,
        draft=draft,
        draft_cfg=cfg.draft,
        reference=reference,
        decoupled=cfg.pipeline.max_lag > 0,
        device=device,
        dtype=resolve_dtype(cfg.learner.dtype, "learner.dtype"),
    )


def to_cpu(tree):
    """Every tensor of a nested dict / list / tuple on the CPU (tensors there already are
    returned as they are, not copied)."""
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_cpu(v) for v in tree)
    return tree


class LocalLearnerHost:
    """The learner in this process."""

    def __init__(
        self,
        cfg: TrainConfig,
        policy: Transformer,
        draft: TrainableDraft | None,
        device: torch.device | None = None,
    ) -> None:
        self.policy, self.draft = policy, draft
        self.learner = build_learner(cfg, policy, draft, device)

    def logprobs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N, T] log-probs (CPU, fp32) of the batch under the policy and (if any) the
        reference."""
        lr = self.learner
        ref = lr.logprobs(batch, lr.reference) if lr.reference is not None else None
        return lr.logprobs(batch), ref

    def train(self, batch: Batch, old: torch.Tensor, ref: torch.Tensor | None) -> dict:
        return self.learner.train(batch, old, ref)

    def weights(self) -> tuple[State, State | None]:
        """What `Rollout.publish` takes: the policy's and the draft's tensors by name (on
        the learner's device: the rollout side copies them into its own)."""
        return state(self.policy), state(self.draft)

    def state(self) -> dict:
        """Weights and optimizer states for a checkpoint, on the CPU (on a CPU learner
        these are the tensors themselves, not copies)."""
        out = {"policy": self.policy.state_dict(), "policy_opt": self.learner.opt.state_dict()}
        if self.draft is not None:
            out["draft"] = self.draft.state_dict()
        if self.learner.draft_opt is not None:
            out["draft_opt"] = self.learner.draft_opt.state_dict()
        return to_cpu(out)

    def restore(self, state: dict) -> None:
        """Load a `state()` written on any device: weights are copied into the learner's
        tensors, and each optimizer moves its state onto its parameters' device. A
        sharded checkpoint (`learner.strategy: fsdp`, any rank count) is read with DCP."""
        if "policy" not in state:
            from specroll.rl import dcp_state

            dcp_state.load(self.learner, self.draft, Path(state["path"]) / "learner")
            return
        with torch.no_grad():
            self.policy.load_state_dict(state["policy"])
            if self.draft is not None:
                self.draft.load_state_dict(state["draft"])
        self.learner.opt.load_state_dict(state["policy_opt"])
        if self.learner.draft_opt is not None:
            self.learner.draft_opt.load_state_dict(state["draft_opt"])

    def export(self, out: Path) -> None:
        """The trained policy (HF dir) and draft (its serving layout: vLLM's for EAGLE-3)."""
        from specroll.model.weights import save_model

        save_model(self.policy, out / "policy")
        if self.draft is not None:
            self.draft.save(out / "draft")

    def close(self) -> None:
        pass


class LearnerActor(LocalLearnerHost):
    """The learner in a Ray actor, built from shipped configs and weights."""

    def __init__(self, cfg: TrainConfig, model_cfg, draft_spec, policy_sd, draft_sd) -> None:
        """draft_spec: (TrainableDraft class, its config), or None without a draft."""
        # Ray sets one thread for actors that reserve no CPU; the learner takes its own
        # reservation, or the node's cores when it reserves none (as a driver would)
        torch.set_num_threads(int(cfg.ray.learner_cpus) or os.cpu_count() or 1)
        torch.manual_seed(cfg.pipeline.seed)
        device = None
        if cfg.learner.device == "auto":
            import ray

            # the GPU Ray assigned (the one CUDA_VISIBLE_DEVICES shows the actor), never
            # another of the node's; the CPU when it assigned none
            device = torch.device("cuda" if ray.get_gpu_ids() else "cpu")
        policy = Transformer(model_cfg)
        policy.load_state_dict(policy_sd)
        draft = None
        if draft_spec is not None:
            cls, draft_cfg = draft_spec
            draft = cls(draft_cfg, policy)
            draft.load_state_dict(draft_sd)
        super().__init__(cfg, policy, draft, device)

    def weight_refs(self) -> list:
        """[policy_ref, draft_ref]: the weights put into the object store by this actor,
        as CPU tensors (a worker without this actor's GPU must be able to read them)."""
        import ray

        return [ray.put(to_cpu(state(self.policy))), ray.put(to_cpu(state(self.draft)))]


class RayLearnerHost:
    """Proxy to a `LearnerActor`; the same methods as `LocalLearnerHost`."""

    def __init__(self, cfg: TrainConfig, policy: Transformer, draft: TrainableDraft | None) -> None:
        import ray

        rc = cfg.ray
        actor = ray.remote(num_cpus=rc.learner_cpus, num_gpus=rc.learner_gpus)(LearnerActor)
        dspec = (type(draft), draft.cfg) if draft is not None else None
        self.actor = actor.remote(cfg, policy.cfg, dspec, state(policy), state(draft))

    def _get(self, ref):
        import ray

        return ray.get(ref)

    def logprobs(self, batch: Batch):
        return self._get(self.actor.logprobs.remote(batch))

    def train(self, batch: Batch, old, ref) -> dict:
        return self._get(self.actor.train.remote(batch, old, ref))

    def weights(self):
        """Object-store references (put by the actor), for `RayRollout.publish`."""
        return tuple(self._get(self.actor.weight_refs.remote()))

    def state(self) -> dict:
        return self._get(self.actor.state.remote())

    def restore(self, state: dict) -> None:
        self._get(self.actor.restore.remote(state))

    def export(self, out: Path) -> None:
        self._get(self.actor.export.remote(out))

    def close(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


def build_host(
    cfg: TrainConfig, policy: Transformer, draft: TrainableDraft | None
) -> LocalLearnerHost | RayLearnerHost:
    """The learner's placement: `learner.ranks` FSDP ranks (`learner.strategy: fsdp`:
    Ray actors in a placement group with `rollout.backend: ray`, see `rl.fsdp_ray`, else
    local processes, `rl.fsdp_host`), a Ray actor when rollouts run on Ray (`rollout.backend:
    ray`, so that weights go from the actor to the workers without the driver), else
    this process."""
    if cfg.learner.strategy == "fsdp" and cfg.rollout.backend == "ray":
        from specroll.rl.fsdp_ray import RayFSDPLearnerHost

        return RayFSDPLearnerHost(cfg, policy, draft)
    if cfg.learner.strategy == "fsdp":
        from specroll.rl.fsdp_host import FSDPLearnerHost

        return FSDPLearnerHost(cfg, policy, draft)
    if cfg.rollout.backend == "ray":
        return RayLearnerHost(cfg, policy, draft)
    return LocalLearnerHost(cfg, policy, draft)
