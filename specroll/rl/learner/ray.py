"""The learner in a Ray actor (`learner.placement: ray`, one rank).

`RayLearnerHost` moves the learner into a `LearnerActor` (CPUs / GPUs from
`ray.learner_cpus` / `learner_gpus`; `learner.device: auto` there is the GPU Ray gave the
actor, else its CPU) and publishes weights straight from the actor into the object
store: rollout workers read them there, the driver never holds a copy.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specroll.drafting.trainable import TrainableDraft
from specroll.model.transformer import Transformer
from specroll.rl.algo.batch import Batch
from specroll.rl.cluster import connect
from specroll.rl.config import TrainConfig
from specroll.rl.learner.build import learner_device
from specroll.rl.learner.single import LocalLearnerHost
from specroll.rl.replica import ReplicaSpec, State, Weights, tensors_of, to_cpu


class LearnerActor(LocalLearnerHost):
    """The learner in a Ray actor, built from a replica spec and shipped weights."""

    def __init__(
        self, cfg: TrainConfig, spec: ReplicaSpec, policy: State, draft: State | None
    ) -> None:
        import ray

        # Ray sets one thread for actors that reserve no CPU; the learner takes its own
        # reservation, or the node's cores when it reserves none (as a driver would)
        torch.set_num_threads(int(cfg.ray.learner_cpus) or os.cpu_count() or 1)
        torch.manual_seed(cfg.pipeline.seed)
        # the GPU Ray assigned (the one CUDA_VISIBLE_DEVICES shows the actor), never
        # another of the node's; the CPU when it assigned none
        device = learner_device(cfg.learner, gpu_assigned=bool(ray.get_gpu_ids()))
        super().__init__(cfg, *spec.build(policy, draft), device)

    def weight_refs(self) -> list:
        """[policy_ref, draft_ref]: the weights put into the object store by this actor,
        as CPU tensors (a worker without this actor's GPU must be able to read them)."""
        import ray

        w = Weights.of(self.policy, self.draft)  # (of a LoRA policy: its adapters)
        return [ray.put(to_cpu(w.policy)), ray.put(to_cpu(w.draft))]


class RayLearnerHost:
    """Proxy to a `LearnerActor`; the host interface."""

    def __init__(self, cfg: TrainConfig, policy: Transformer, draft: TrainableDraft | None) -> None:
        import ray

        connect(cfg)
        ray_cfg = cfg.ray
        actor = ray.remote(num_cpus=ray_cfg.learner_cpus, num_gpus=ray_cfg.learner_gpus)(
            LearnerActor
        )
        spec = ReplicaSpec.of(policy, draft)
        self.actor = actor.remote(cfg, spec, tensors_of(policy), tensors_of(draft))

    def _get(self, ref):
        import ray

        return ray.get(ref)

    def logprobs(self, batch: Batch, exact: bool = False):
        return self._get(self.actor.logprobs.remote(batch, exact))

    def train(self, batch: Batch, old, ref, lr: float | None = None) -> dict:
        return self._get(self.actor.train.remote(batch, old, ref, lr))

    def weights(self) -> Weights:
        """Object-store references, put by the actor."""
        return Weights(*self._get(self.actor.weight_refs.remote()), remote=True)

    def checkpoint_state(self) -> dict:
        return self._get(self.actor.checkpoint_state.remote())

    def save_sharded(self, ckpt_dir: Path) -> None:
        """Nothing: the whole state is in `checkpoint_state`."""

    def restore(self, state: dict) -> None:
        self._get(self.actor.restore.remote(state))

    def export(self, out: Path) -> None:
        self._get(self.actor.export.remote(out))

    def close(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)
