"""Ray for a run: start or join a cluster, and check up front that it holds the actors the
run asks for (Ray would otherwise wait forever for resources that never come)."""

from __future__ import annotations

import socket
import time

from specroll.rl.config import TrainConfig

PROBE_TIMEOUT_S = 5.0
"""How long `probe` waits for a cluster's GCS port to accept a connection (ray.init
itself retries for half a minute, or for ever on some addresses, then tracebacks)."""


def require_ray(setting: str) -> None:
    """ValueError naming `setting` unless Ray is installed."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        raise ValueError(f"{setting} needs Ray: pip install 'specroll[ray]'") from e


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of a `ray.address` to join ('host:port' or 'ray://host:port'); None
    for '' (start a local Ray) and 'auto' (Ray finds the address itself)."""
    rest = address.strip().removeprefix("ray://")
    if not rest or rest == "auto":
        return None
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(
            f"ray.address={address!r}: expected '', 'auto', 'HOST:PORT' or 'ray://HOST:PORT'"
        )
    return host.strip("[]"), int(port)


def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """ValueError saying `address` is unreachable, and how long was waited, unless its
    host accepts a TCP connection on its port within `timeout` seconds (before ray.init,
    which would retry long and end in a traceback, or hang)."""
    target = host_port(address)
    if target is None:
        return
    t0 = time.monotonic()
    try:
        with socket.create_connection(target, timeout=timeout):
            return
    except OSError as e:
        waited = time.monotonic() - t0
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise ValueError(
            f"ray.address={address!r} is unreachable: no Ray cluster answered at "
            f"{target[0]}:{target[1]} ({why}, waited {waited:.1f}s of {timeout:g}s); "
            "start one with `ray start --head`, or set ray.address='' for a local Ray"
        ) from None


def connect(cfg: TrainConfig) -> None:
    """Start or join Ray (`ray.address`) and check the cluster can hold the rollout workers
    (`rollout.backend: ray`) and the learner's actors (`learner.placement: ray`)."""
    import ray

    ray_cfg = cfg.ray
    if not ray.is_initialized():
        probe(ray_cfg.address)
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
