"""What the step loop asks of the rollout side: a step's rollouts through the window of
steps in flight (asynchronous RL)."""

from __future__ import annotations

from specroll.engine.request import Request, Results
from specroll.rl.rollout.base import Pending, RolloutBackend
from specroll.rl.run.task import Task


class RolloutWindow:
    """The submissions of steps s..s + `max_lag`, kept in flight while the learner trains.

    Synchronous (max_lag 0): a step generates now with the current weights (version s).
    Asynchronous: steps s..s+max_lag are kept submitted — a step is submitted with the
    weights current at submission, so its samples are at most max_lag versions old when
    trained on — and `take(s)` waits for step s's. Samples older than max_lag (possible
    only after a resume or from a foreign submission) are dropped, counted, and their step
    regenerated with the current weights."""

    def __init__(self, rollout: RolloutBackend, task: Task, max_lag: int, steps: int) -> None:
        self.rollout, self.task = rollout, task
        self.max_lag, self.steps = max_lag, steps
        self.dropped = 0
        """Samples dropped for being more than max_lag versions old."""
        self._inflight: dict[int, Pending] = {}

    def take(self, s: int, requests: list[Request]) -> tuple[Results, dict[int, int]]:
        """Step s's rollouts of `requests` (its `task.step_requests`) and {lag: samples}."""
        lag_max = self.max_lag
        for t in range(s, min(s + lag_max, self.steps - 1) + 1):
            if t not in self._inflight:
                reqs = requests if t == s else self.task.step_requests(t)
                self._inflight[t] = self.rollout.submit(reqs)
        results = self._inflight.pop(s).result()
        stale = sum(s - r.policy_version > lag_max for r in results)
        if stale:
            self.dropped += stale
            results = self.rollout.generate(requests)
        lag: dict[int, int] = {}
        for r in results:
            want_draft = r.policy_version if self.rollout.speculative else None
            if r.draft_version != want_draft or not 0 <= s - r.policy_version <= lag_max:
                raise RuntimeError(
                    f"step {s}: a rollout was generated with policy/draft versions "
                    f"{r.policy_version}/{r.draft_version}; expected policy in "
                    f"[{s - lag_max}, {s}] and the draft of the same version"
                )
            lag[s - r.policy_version] = lag.get(s - r.policy_version, 0) + 1
        return results, lag

    def clear(self) -> None:
        """Discard the submissions in flight."""
        self._inflight.clear()
