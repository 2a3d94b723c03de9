"""Where rollouts are generated: in this process, or on Ray rollout workers.

The pipeline sees one interface whatever the placement (one loop, two placements):

* `submit(requests, version)` hands a step's requests to the rollout side and returns a
  `Pending`; `Pending.result()` waits for them and gives the results in request order
  with the merged speculation counters. In-process generation runs at submit time; on
  Ray it runs on the workers while the learner goes on (asynchronous RL).
* `publish(version, policy, draft)` makes new weights available under a version (stage
  `prepare`); every result records the versions it was generated with.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from specroll.engine.engine import Engine
from specroll.engine.request import Request, Result
from specroll.rl.sync import LocalSync
from specroll.spec.metrics import SpecStats


class Pending:
    """Requests handed to the rollout side; `result()` blocks until they are done."""

    def result(self) -> tuple[list[Result], SpecStats]:
        raise NotImplementedError


class Done(Pending):
    def __init__(self, results: list[Result], stats: SpecStats) -> None:
        self._out = (results, stats)

    def result(self) -> tuple[list[Result], SpecStats]:
        return self._out


class Rollout:
    """Generation backend: submit requests, publish weights."""

    restarts: int = 0
    """Rollout workers restarted after a failure (their requests were re-queued)."""

    def submit(self, requests: Sequence[Request], plain: bool = False) -> Pending:
        """Generate `requests` with the latest published weights (plain: no drafter)."""
        raise NotImplementedError

    def generate(self, requests: Sequence[Request], plain: bool = False):
        return self.submit(requests, plain).result()

    def publish(self, version: int, policy: nn.Module, draft: nn.Module | None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalRollout(Rollout):
    """The engine in this process; generation happens inside `submit`."""

    def __init__(self, engine: Engine, engine_draft: nn.Module | None = None) -> None:
        self.engine = engine
        self.sync = LocalSync(engine, engine_draft)
        self._plain: Engine | None = None

    def submit(self, requests: Sequence[Request], plain: bool = False) -> Pending:
        eng = self.engine
        if plain and eng.drafter is not None:
            if self._plain is None:  # plain decoding on the very same weights
                self._plain = Engine(eng.model, eng.config)
            self._plain.policy_version = eng.policy_version
            eng = self._plain
        return Done(eng.generate(requests), eng.stats)

    def publish(self, version: int, policy: nn.Module, draft: nn.Module | None) -> None:
        self.sync.publish(version, policy, draft)
