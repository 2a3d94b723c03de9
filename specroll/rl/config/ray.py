"""The ray section of a run's configuration: rollout workers and learner actors on a Ray cluster."""

from __future__ import annotations

from dataclasses import dataclass

from specroll.rl.config.io import bound, check, one_of

WORKER_BACKENDS = ("local", "vllm")
"""In-process backends a Ray rollout worker can run (`ray.worker_backend`)."""


MAX_RAY_WORKERS = 1024
"""Most Ray rollout workers (`ray.workers`), as many as learner ranks may be."""


@dataclass
class RayConfig:
    """Ray placement: rollout workers (`rollout.backend: ray`), each an engine replica
    (policy + draft), and the learner's actors (`learner.placement: ray`)."""

    worker_backend: str = "local"
    """The engine inside each worker: 'local' (specroll's engine) or 'vllm' (one vLLM engine
    per worker, started on the first weights it is sent; `pip install -e .[vllm]`)."""
    address: str = ""
    """'' = start a local Ray; otherwise a cluster address to join ('auto', 'ray://...')."""
    workers: int = 2
    """Rollout workers (engine replicas); each takes a share of every step's prompts."""
    cpus_per_worker: float = 1.0
    """CPUs each worker reserves (and its torch threads)."""
    gpus_per_worker: float = 0.0
    """GPUs each worker reserves (0 on CPU machines)."""
    max_restarts: int = 3
    """Times a step may restart dead workers (re-queueing their prompts) before failing."""
    learner_cpus: float = 0.0
    """CPUs each learner actor (rank) reserves (0 = none: it shares the node, as a driver
    would)."""
    learner_gpus: float = 0.0
    """GPUs each learner actor (rank) reserves."""

    def __post_init__(self) -> None:
        one_of("ray", self, "worker_backend", WORKER_BACKENDS)
        bound("ray", self, "workers", 1)
        check(
            self.workers <= MAX_RAY_WORKERS,
            f"ray.workers must be <= {MAX_RAY_WORKERS} (each is a process with its own "
            f"copy of the policy), got {self.workers}",
        )
        bound("ray", self, "cpus_per_worker", 0, above=True)
        bound("ray", self, "gpus_per_worker", 0)
        bound("ray", self, "max_restarts", 0)
        bound("ray", self, "learner_cpus", 0)
        bound("ray", self, "learner_gpus", 0)
