"""The FSDP learner's ranks as Ray actors in one placement group (`rollout.backend: ray`).

The same ranks (`rank.RankLearner`) and the same host interface as the local processes
of `host`; here each rank is an actor on a bundle of one placement
group (`ray.learner_cpus` / `ray.learner_gpus` per rank, packed: the ranks of a step talk
on every block, so they are kept together when the cluster allows). They meet over TCP
at rank 0's node. Published weights go from rank 0 into the object store one tensor at
a time (rank 0 holds one full tensor at a time, the object store the published copy).

What Ray does on its own when a rank dies: nothing that could save the step. The actors
are created with `max_restarts=0` (a restarted rank could not rejoin the process group,
whose other members are blocked in a collective), so Ray marks the actor dead, the
placement group keeps its bundles, and the pending calls raise `ActorDiedError`; the host
turns that into `LearnerRankError` naming the rank and kills the others. `--resume`
continues from the last checkpoint.
"""

from __future__ import annotations

from specroll.drafting.trainable import TrainableDraft
from specroll.model.transformer import Transformer
from specroll.model.untrusted import UnreadableFile
from specroll.rl.algo.batch import Batch
from specroll.rl.cluster import connect
from specroll.rl.config import TrainConfig
from specroll.rl.errors import LearnerRankError
from specroll.rl.learner.fsdp.host import ShardedCheckpoints, streamed_weights
from specroll.rl.learner.fsdp.rank import RankLearner
from specroll.rl.replica import ReplicaSpec, Weights, tensors_of


class RankActor:
    """One rank in a Ray actor."""

    def __init__(self, *args) -> None:
        self.worker = RankLearner(*args)

    def run(self, name: str, args: tuple):
        """(answer, object refs of the streamed items) of command `name`."""
        import ray

        refs: list = []
        value = getattr(self.worker, name)(*args, emit=lambda item: refs.append(ray.put(item)))
        return value, refs


def _address() -> tuple[str, int]:
    """This node's IP and a free TCP port (rank 0's rendezvous)."""
    import socket

    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


class RayFSDPLearnerHost(ShardedCheckpoints):
    """`learner.ranks` Ray actors in one placement group; rank 0 answers."""

    def __init__(self, cfg: TrainConfig, policy: Transformer, draft: TrainableDraft | None) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        connect(cfg)
        ray_cfg, self.world = cfg.ray, cfg.learner.ranks
        bundle = {"CPU": max(ray_cfg.learner_cpus, 1e-3)}
        if ray_cfg.learner_gpus:
            bundle["GPU"] = ray_cfg.learner_gpus
        self.pg = placement_group([bundle] * self.world, strategy="PACK")
        ray.get(self.pg.ready())

        def on(r: int):
            return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r)

        ip, port = ray.get(ray.remote(num_cpus=0, scheduling_strategy=on(0))(_address).remote())
        actor = ray.remote(num_cpus=bundle["CPU"], num_gpus=ray_cfg.learner_gpus, max_restarts=0)
        actor = actor(RankActor)
        spec = ReplicaSpec.of(policy, draft)
        psd, dsd = ray.put(tensors_of(policy)), ray.put(tensors_of(draft))
        init = f"tcp://{ip}:{port}"
        self.actors = [
            actor.options(scheduling_strategy=on(r)).remote(
                r, self.world, init, cfg, spec, psd, dsd
            )
            for r in range(self.world)
        ]
        self.failed: str | None = None
        self._wait([a.__ray_ready__.remote() for a in self.actors], "start")

    def _wait(self, futures: list, name: str) -> list:
        import ray

        try:
            return ray.get(futures)
        except ray.exceptions.RayActorError:
            dead = []
            for r, f in enumerate(futures):
                try:
                    ray.get(f, timeout=5)
                except ray.exceptions.RayActorError:
                    dead.append(r)
                except Exception:  # noqa: BLE001 - a survivor's broken collective
                    pass
            self.failed = (
                f"learner rank {dead[0] if dead else '?'} died during {name!r}; the step did "
                "not happen: continue from the last checkpoint with --resume"
            )
            self.close()
            raise LearnerRankError(self.failed) from None
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, UnreadableFile):  # a refused checkpoint file: one line
                raise UnreadableFile(str(e.cause)) from None
            raise

    def _call(self, name: str, *args):
        if self.failed:
            raise LearnerRankError(self.failed)
        return self._wait([a.run.remote(name, args) for a in self.actors], name)[0]

    def logprobs(self, batch: Batch, exact: bool = False):
        return self._call("logprobs", batch, exact)[0]

    def train(self, batch: Batch, old, ref, lr: float | None = None) -> dict:
        return self._call("train", batch, old, ref, lr)[0]

    def weights(self) -> Weights:
        """The full tensors rank 0 put into the object store, one at a time."""
        import ray

        has_draft, refs = self._call("weights")
        return streamed_weights([ray.get(ref)[2] for ref in refs], has_draft)

    def memory(self) -> list[dict]:
        return self._call("memory")[0]

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
