"""The rollout backend interface: every place rollouts are generated answers the same verbs
(the vocabulary of NeMo-RL's generation interface).

* `submit(requests)` hands requests to the rollout side and returns a `Pending`;
  `Pending.result()` waits for them and gives one `Results`: the results in request
  order, with the call's merged speculation counters in `.stats`. An in-process backend
  generates at submit time; on Ray the workers generate while the learner goes on
  (asynchronous RL). `generate` is submit + result.
* `update_weights(version, weights)` loads a published `Weights` handle (tensors here or
  object references) under `version`; `policy_version` / `draft_version` say what the
  backend now holds, and every result records the versions it was generated with.
* `close()` releases engines and workers.

Measurement is not part of it: a backend that can decode a step's requests again on the
same weights without speculation also implements `PlainShadow`, and one that can draft
them with other drafters made of its own drafter's parts `DrafterShadow`; the shadow
probe (`rl.run.shadow`) asks for them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from specroll.engine.request import Request, Results
from specroll.rl.replica import Weights


class Pending(ABC):
    """Requests handed to the rollout side; `result()` blocks until they are done."""

    @abstractmethod
    def result(self) -> Results:
        """The results in request order, with the merged counters in `.stats`."""


class Done(Pending):
    """A submission that was generated at submit time (in-process backends)."""

    def __init__(self, results: Results) -> None:
        self._results = results

    def result(self) -> Results:
        return self._results


class RolloutBackend(ABC):
    """Where rollouts are generated: submit requests, update weights, close."""

    speculative: bool = False
    """Whether rollouts are drafted (results then carry a draft version)."""
    restarts: int = 0
    """Rollout workers restarted after a failure (their requests were re-queued)."""

    @property
    @abstractmethod
    def policy_version(self) -> int:
        """The version of the policy weights the next submission generates with."""

    @property
    def draft_version(self) -> int | None:
        """The draft's version (the policy's: they are published together), or None
        without speculation."""
        return self.policy_version if self.speculative else None

    @abstractmethod
    def submit(self, requests: Sequence[Request]) -> Pending:
        """Generate `requests` with the latest weights."""

    def generate(self, requests: Sequence[Request]) -> Results:
        """`submit(...).result()`."""
        return self.submit(requests).result()

    @abstractmethod
    def update_weights(self, version: int, weights: Weights) -> None:
        """Load `weights` under `version` (a None draft keeps the draft's weights)."""

    def drafter_state(self) -> dict | None:
        """What the drafter learnt from the rollouts (the history drafter's store), for a
        checkpoint; None when it keeps nothing a resumed run would need."""
        return None

    def load_drafter_state(self, state: dict) -> None:
        """Restore `drafter_state` (a resumed run drafts as the interrupted one would)."""
        raise ValueError("this rollout backend keeps no drafter state to restore")

    def close(self) -> None:  # noqa: B027 - a backend without workers has nothing to release
        """Release engines and workers (in-flight submissions are discarded)."""


@runtime_checkable
class PlainShadow(Protocol):
    """A backend that decodes requests without speculation on the weights it holds: the
    plain side of the measured generation speed-up (`pipeline.shadow_every`)."""

    def generate_plain(self, requests: Sequence[Request]) -> Results:
        """`requests` decoded plainly with the latest weights (never trained on)."""
        ...


@runtime_checkable
class DrafterShadow(Protocol):
    """A backend that drafts requests with other drafters made of its own drafter's parts
    (`pipeline.shadow_drafters`)."""

    def drafter_snapshot(self) -> dict | None:
        """What the drafter has learnt so far (the history store), taken before a step's
        rollouts join it: what that step's shadow drafters start from."""
        ...

    def alternative(
        self, name: str, before: dict | None
    ) -> AbstractContextManager[Callable[[Sequence[Request]], Results]]:
        """Enter: the drafter `name` is built (and, for adaptive depth, profiled) and its
        history set to `before`; yields a function generating with it on the run's
        weights. Exit: the run's drafter is as it was."""
        ...
