"""Ray for a run: start or join a cluster, and check up front that it holds the actors the
run asks for (Ray would otherwise wait forever for resources that never come)."""

from __future__ import annotations

from specroll.rl.config import TrainConfig


def uses_ray(cfg: TrainConfig) -> bool:
    """Whether the run places anything on Ray (rollout workers or the learner)."""
    return cfg.rollout.backend == "ray" or cfg.learner.placement == "ray"


def require_ray(setting: str) -> None:
    """ValueError naming `setting` unless Ray is installed."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{setting} needs Ray: pip install 'specroll[ray]'") from e


def connect(cfg: TrainConfig) -> None:
    """Start or join Ray (`ray.address`) and check the cluster can hold the rollout workers
    (`rollout.backend: ray`) and the learner's actors (`learner.placement: ray`)."""
    import ray

    ray_cfg = cfg.ray
    if not ray.is_initialized():
        ray.init(
            address=ray_cfg.address or None,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    workers = ray_cfg.workers if cfg.rollout.backend == "ray" else 0
    ranks = cfg.learner.ranks if cfg.learner.placement == "ray" else 0
    have = ray.cluster_resources()
    for res, need, names in (
        (
            "CPU",
            workers * ray_cfg.cpus_per_worker + ranks * ray_cfg.learner_cpus,
            "cpus_per_worker, learner_cpus",
        ),
        (
            "GPU",
            workers * ray_cfg.gpus_per_worker + ranks * ray_cfg.learner_gpus,
            "gpus_per_worker, learner_gpus",
        ),
    ):
        if need > have.get(res, 0.0) + 1e-9:
            raise ValueError(
                f"ray: {workers} rollout workers and {ranks} learner actor(s) need {need:g} "
                f"{res}s, the cluster has {have.get(res, 0.0):g}; lower ray.workers or "
                f"ray.{{{names}}}"
            )
