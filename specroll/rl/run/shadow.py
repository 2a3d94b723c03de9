"""The shadow probe: at every `pipeline.shadow_every`-th step (at 5: steps 5, 10, ..., as
checkpoints and validations count them; not the first step, which a new user waits for
and on which the online draft has not trained yet), the step's requests decoded again on
the same weights — without speculation, and with each of `pipeline.shadow_drafters` —
timed, scored and discarded (never trained on).

It measures what speculation buys on this run (`gen_speedup`, `gen_rate_speedup`) and
what other drafters would buy (`shadow/<drafter>/...`), on the run's own prompts and
weights. It stays out of the step's stages: the trainer calls `around` the generation
stage and `metrics` once the step is done; the backend's part is an optional capability
(`rollout.base.PlainShadow`, `DrafterShadow`), which backends that can shadow provide.

Fairness: the plain run goes first every other time it runs, so that neither side always
comes right after the learner's update (caches, allocator); the shadow drafters run in
an order that rotates with the step; and a drafter that drafts from history starts from
the store as it was before the step's rollouts joined it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from specroll.engine.request import Request, Results
from specroll.rl.config import TrainConfig
from specroll.rl.rollout.base import DrafterShadow, PlainShadow, RolloutBackend
from specroll.rl.run.report import tau_table
from specroll.rl.run.task import Task
from specroll.tasks.arithmetic import Problem


class ShadowProbe:
    """Shadow rollouts of the steps `pipeline.shadow_every` names (module docstring)."""

    def __init__(self, cfg: TrainConfig, rollout: RolloutBackend, task: Task) -> None:
        self.every, self.names = cfg.pipeline.shadow_every, cfg.pipeline.shadow_drafters
        # async steps are generated ahead, with older weights: no like-for-like shadow
        on = bool(self.every) and rollout.speculative and not cfg.pipeline.max_lag
        self.plain = rollout if on and isinstance(rollout, PlainShadow) else None
        self.drafters = rollout if self.plain and isinstance(rollout, DrafterShadow) else None
        if self.names and self.plain and self.drafters is None:
            raise ValueError("pipeline.shadow_drafters needs a backend that can run them")
        self.task = task
        self._plain: tuple[float, Results] | None = None  # (seconds, results)
        self._others: dict[str, tuple[float, Results]] = {}

    @contextmanager
    def around(self, step: int, requests: list[Request]) -> Iterator[None]:
        """Around step `step`'s generation of `requests`: the shadow runs of a probed step,
        before or after it (timed apart from it)."""
        self._plain, self._others = None, {}
        if self.plain is None or (step + 1) % self.every:
            yield
            return
        first = ((step + 1) // self.every) % 2 == 0
        if first:
            self._plain = _timed(self.plain.generate_plain, requests)
        before = self.drafters.drafter_snapshot() if self.names else None
        yield
        if not first:
            self._plain = _timed(self.plain.generate_plain, requests)
        order = list(self.names)
        if order:
            r = step % len(order)
            order = order[r:] + order[:r]
        for name in order:
            with self.drafters.alternative(name, before) as generate:
                self._others[name] = _timed(generate, requests)

    def metrics(self, problems: list[Problem], group: int, gen_s: float, gen_tokens: int) -> dict:
        """The probed step's shadow figures (none for other steps): the plain run's time,
        tokens and reward and the speed-ups over it of the step's own generation (`gen_s`
        seconds for `gen_tokens` tokens) and of each shadow drafter. On the same weights
        every drafter and plain decoding draw the same distribution, so their rewards
        must agree."""
        if self._plain is None:
            return {}
        shadow_s, plain = self._plain
        shadow_tok = sum(len(r.token_ids) for r in plain)
        # speculative and plain decoding draw the same distribution, not the same
        # samples: the two runs' lengths differ, so the time ratio (the step's saving)
        # moves with them, and the token-rate ratio measures the decoding
        m = {
            "shadow_ar_gen_s": round(shadow_s, 3),
            "shadow_ar_gen_tokens": shadow_tok,
            "gen_speedup": round(shadow_s / gen_s, 4),
            "gen_rate_speedup": round((gen_tokens / gen_s) / (shadow_tok / shadow_s), 4),
        }
        runs = {"plain": plain} | {n: res for n, (_, res) in self._others.items()}
        mean = {n: float(self.task.rewards(problems, res, group).mean()) for n, res in runs.items()}
        m["shadow_ar_reward"] = round(mean.pop("plain"), 4)
        for name, (seconds, results) in sorted(self._others.items()):
            spec = results.stats
            n_tok = sum(len(r.token_ids) for r in results)
            rate = (n_tok / max(seconds, 1e-9)) / (shadow_tok / max(shadow_s, 1e-9))
            m[f"shadow/{name}/gen_rate_speedup"] = round(rate, 4)
            m[f"shadow/{name}/acceptance_length"] = round(spec.acceptance_length, 4)
            m[f"shadow/{name}/tokens_per_target_forward"] = round(spec.tokens_per_target_forward, 4)
            m[f"shadow/{name}/gen_s"] = round(seconds, 3)
            m[f"shadow/{name}/tau_at"] = tau_table(spec)
            m[f"shadow/{name}/reward"] = round(mean[name], 4)
        return m


def _timed(generate, requests: Sequence[Request]) -> tuple[float, Results]:
    """(seconds, results) of `generate(requests)`."""
    t0 = time.perf_counter()
    results = generate(requests)
    return time.perf_counter() - t0, results
