"""`rollout.backend: ray`: rollout workers, Ray actors each holding one in-process backend
(`ray.worker_backend`: specroll's engine, or one vLLM engine) built by the same factory as
the driver's (`build_backend`).

* **Placement.** Each worker reserves `cpus_per_worker` CPUs (its torch threads) and
  `gpus_per_worker` GPUs (`rl.cluster.connect` checks the cluster holds them). A step's
  requests are dealt round-robin to the workers; the results come back in request order.
  Every request carries its own seed and the engine's RNG is counter-based, so a
  request's tokens do not depend on the worker or the batch it ran in: the Ray placement
  reproduces the in-process run exactly.
* **Weights.** `update_weights` puts the policy and draft tensors into the object store
  once per version (or takes the references a learner actor put there); every
  submission names the version it must run with, and a worker whose weights are older
  fetches that version (shared memory on a node) before generating. So a submission for
  a future step (asynchronous RL) and a re-queued one after a restart both run with the
  weights they were submitted under. A worker refuses a draft whose tensor names or
  shapes differ from its own, with the offending name.
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

from specroll.drafting.trainable import TrainableDraft
from specroll.engine.request import Request, Result, Results
from specroll.model.transformer import Transformer
from specroll.rl.cluster import connect, require_ray
from specroll.rl.config import TrainConfig
from specroll.rl.replica import ReplicaSpec, Weights, tensors_of
from specroll.rl.rollout import build_backend
from specroll.rl.rollout.base import Pending, RolloutBackend
from specroll.rl.rollout.vllm import require_eagle3, require_vllm
from specroll.spec.metrics import SpecStats


def worker_config(cfg: TrainConfig) -> TrainConfig:
    """The run's config as a worker's inner backend sees it: `rollout.backend` is
    `ray.worker_backend`."""
    rollout = dataclasses.replace(cfg.rollout, backend=cfg.ray.worker_backend)
    return dataclasses.replace(cfg, rollout=rollout)


class RolloutWorker:
    """One in-process rollout backend in its own process (run as a Ray actor)."""

    def __init__(
        self, cfg: TrainConfig, spec: ReplicaSpec, prompts: list[list[int]], base: list
    ) -> None:
        """The backend is built on the first weights the worker is sent (a vLLM engine
        loads its weights when it starts), with its draft and (adaptive depth) its cost
        profile, on the worker's own threads and device: a profile measured on the driver
        would describe another machine."""
        torch.set_num_threads(max(1, int(cfg.ray.cpus_per_worker)))
        if cfg.ray.worker_backend == "vllm":
            # the worker's threads are Ray's to place: vLLM's auto binding would pin every
            # worker on a node to the same cores
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.cfg, self.spec, self.prompts = worker_config(cfg), spec, prompts
        self.base = base
        """[a reference to a LoRA policy's whole state] (its refits carry only the
        adapters: the worker builds on this), or []."""
        self.backend: RolloutBackend | None = None
        self.version: int | None = None

    def generate(
        self, requests: list[Request], plain: bool, version: int, weights: list
    ) -> Results:
        """Generate with weights `version` (fetched from `weights` = [policy_ref,
        draft_ref or None when the draft is unchanged, the last draft_ref published] — a
        list, so Ray hands the references over unresolved — if not held already). A new
        backend is built on the last draft published, the one the others hold."""
        if self.version != version:
            update = Weights(weights[0], weights[1], remote=True)
            with torch.no_grad():
                if self.backend is None:
                    policy, draft = Weights(weights[0], weights[2], remote=True).resolve()
                    if self.base:
                        import ray

                        policy = ray.get(self.base[0])
                    policy, draft = self.spec.build(policy, draft)
                    self.backend = build_backend(self.cfg, policy.eval(), draft, self.prompts)
                self.backend.update_weights(version, update)
            self.version = version
        return self.backend.generate_plain(requests) if plain else self.backend.generate(requests)


class RayRollout(RolloutBackend):
    """`ray.workers` rollout workers behind the rollout interface."""

    def __init__(
        self,
        cfg: TrainConfig,
        spec: ReplicaSpec,
        prompts: list[list[int]],
        base: dict | None = None,
    ) -> None:
        """base: a LoRA policy's whole state (put into the object store once: its refits
        carry only the adapters)."""
        import ray

        connect(cfg)
        self.ray_cfg = cfg.ray
        # a history drafter drafts with no network (and stamps the policy's version)
        self.speculative = spec.has_draft or (cfg.rollout.speculative and not cfg.rollout.network)
        self._actor = ray.remote(
            num_cpus=cfg.ray.cpus_per_worker, num_gpus=cfg.ray.gpus_per_worker, max_restarts=0
        )(RolloutWorker)
        self._args = (cfg, spec, prompts, [ray.put(base)] if base is not None else [])
        self.workers = [self._spawn() for _ in range(cfg.ray.workers)]
        self._version = -1
        self.weights: list = []
        self._draft = None
        """The last draft published (a reference): what a new or restarted worker builds on."""
        self.restarts = 0

    @property
    def policy_version(self) -> int:
        return self._version

    def _spawn(self):
        return self._actor.remote(*self._args)

    def update_weights(self, version: int, weights: Weights) -> None:
        """Put the weights into the object store once (remote ones are there already:
        a learner actor put them, the driver never holds them); workers fetch them when a
        submission needs them."""
        if not self.speculative:
            weights = dataclasses.replace(weights, draft=None)
        remote = weights.put()
        if remote.draft is not None:  # None: unchanged (a frozen draft's refits)
            self._draft = remote.draft
        self.weights = [remote.policy, remote.draft, self._draft]
        self._version = version

    def submit(self, requests: Sequence[Request]) -> Pending:
        return self._submit(requests, plain=False)

    def generate_plain(self, requests: Sequence[Request]) -> Results:
        """The requests decoded plainly by the workers, on the same weights (`PlainShadow`)."""
        return self._submit(requests, plain=True).result()

    def _submit(self, requests: Sequence[Request], plain: bool) -> RayPending:
        if self._version < 0:
            raise RuntimeError("update the initial weights before submitting rollouts")
        # a request without an id is named by its position in *this* list, not the share
        requests = [
            r if r.request_id is not None else dataclasses.replace(r, request_id=i)
            for i, r in enumerate(requests)
        ]
        n = len(self.workers)
        shares = [list(range(w, len(requests), n)) for w in range(n)]
        return RayPending(self, list(requests), shares, plain, self._version, self.weights)

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

    def _share(self, s: int) -> Results:
        """Worker slot s's results, restarting it (and re-running its share) on death."""
        import ray
        from ray.exceptions import RayActorError

        limit = self.owner.ray_cfg.max_restarts
        for tries in range(limit + 1):
            try:
                return ray.get(self.futures[s])
            except RayActorError as e:
                if tries == limit:
                    raise RuntimeError(
                        f"rollout worker {s} died {tries + 1} times on one submission "
                        f"(ray.max_restarts={limit}): {e}"
                    ) from e
                self.owner.restart(s, self.handles[s])
                self.handles[s] = self.owner.workers[s]
                reqs = [self.requests[i] for i in self.shares[s]]
                self.futures[s] = self.owner.run(s, reqs, self.plain, self.version, self.weights)
        raise AssertionError("unreachable")

    def result(self) -> Results:
        results: list[Result | None] = [None] * len(self.requests)
        stats = []
        for s, share in enumerate(self.shares):
            out = self._share(s)
            for i, r in zip(share, out, strict=True):
                results[i] = r
            stats.append(out.stats)
        return Results(results, SpecStats.merged(stats))  # type: ignore[arg-type]


def build(
    cfg: TrainConfig,
    policy: Transformer,
    draft: TrainableDraft | None,
    prompts: list[list[int]],
    log=print,
) -> RayRollout:
    """`ray.workers` rollout backends, each built on its worker."""
    require_ray("rollout.backend=ray")
    if cfg.ray.worker_backend == "vllm":
        require_vllm("ray.worker_backend=vllm")  # the workers import it: fail here, clearly
        require_eagle3(draft if cfg.rollout.speculative else None, "ray.worker_backend=vllm")
    speculative = draft is not None and cfg.rollout.speculative
    spec = ReplicaSpec.of(policy, draft if speculative else None)
    base = tensors_of(policy) if policy.lora_spec is not None else None
    return RayRollout(cfg, spec, prompts, base)
