"""Stage `logprob`: where a step's old log-probs (the ratio's denominator) come from.

Recomputed by the learner, or (`learner.recompute_logprobs: auto`, see `engine_usable`)
the engine's own, which equal the learner's to float rounding in fp32: then the learner
recomputes some rows (`CHECK_ROWS`) every `learner.check_every` steps (from step 0), as a
check, and also on the first step a process runs (a resumed run checks its new engine;
that check is recorded only if it fails, so the metrics equal the uninterrupted run's).
A check that passes still trains on the engine's log-probs, so a run does not depend on
when it checked; one that fails (mismatch above the stated bound, `mismatch`) switches the run to
recomputation for good, with a warning, and that switch is part of the checkpoint. The
mismatch statistics are those of every recorded recomputation (on-policy tokens).

A bf16 learner over an fp32 engine (`update_usable`: what `learner.dtype: auto` gives on
a CPU or GPU with native bf16) takes them from the update's own forward instead: on-policy
with one update, the old policy *is* the policy being updated, so the ratio is exactly 1
and the gradient is the bf16 forward's. Its bf16 log-probs differ from the engine's fp32
ones by bf16 rounding (0.2-0.3 at most on SmolLM2), which is not a difference between the
policies, so the check recomputes in fp32 (`exact`): the engine's log-probs against the
learner's fp32 master weights, under the same bound as an fp32 run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specroll.rl.algo.batch import Batch
from specroll.rl.algo.mismatch import logprob_tolerance, mismatch_stats
from specroll.rl.config import TrainConfig

Recompute = Callable[[Batch, bool], tuple[torch.Tensor, torch.Tensor | None]]
"""The learner's (policy [N, T], reference [N, T] or None) log-probs of a batch; with the
flag (`exact`) in fp32 whatever the learner's dtype."""


def engine_usable(cfg: TrainConfig) -> bool:
    """Whether `learner.recompute_logprobs: auto` may take the engine's log-probs as the
    old ones: synchronous (every sample on-policy), fp32 on both sides (bf16 log-probs
    differ by far more than float rounding), and no reference pass needed anyway (KL)."""
    return (
        cfg.learner.recompute_logprobs == "auto"
        and cfg.pipeline.max_lag == 0
        and cfg.rollout.dtype == cfg.learner.dtype == "float32"
        and cfg.loss.kl_coef == 0
    )


def update_usable(cfg: TrainConfig) -> bool:
    """Whether `learner.recompute_logprobs: auto` may take the old log-probs from the
    update's own forward (detached; `Learner.train` with old_logp None): synchronous, one
    update per step, no reference pass, and a bf16 learner (autocast over fp32 master
    weights, one process: its check can run in fp32) over an fp32 engine."""
    return (
        cfg.learner.recompute_logprobs == "auto"
        and cfg.pipeline.max_lag == 0
        and cfg.loss.updates_per_step == 1
        and cfg.loss.kl_coef == 0
        and cfg.rollout.dtype == "float32"
        and cfg.learner.dtype == "bfloat16"
        and cfg.learner.strategy == "single"
    )


CHECK_ROWS = 8
"""On-policy rows an agreement check recomputes: a check looks for weights or numerics that
differ, and those differ on every row (8 rows of a default step hold a few hundred tokens)."""


def _check_rows(batch: Batch, fresh: torch.Tensor) -> list[int]:
    """The `CHECK_ROWS` shortest on-policy rows, in batch order: what a check looks for
    shows on every row, and the shortest cost least (the check recomputes them in fp32,
    the first step's 16 rows, padded to 179 tokens, in 5.8-7.3 s on a 2-core Zen 4)."""
    lengths = batch.lengths.tolist()
    on = [i for i, f in enumerate(fresh.tolist()) if f]
    return sorted(sorted(on, key=lambda i: (lengths[i], i))[:CHECK_ROWS])


class OldLogprobs:
    """The source of the old log-probs, step by step."""

    def __init__(self, cfg: TrainConfig, log: Callable[[str], None] = print) -> None:
        self.cfg, self.log = cfg, log
        self.fallback = False
        """An agreement check failed: recompute from then on (kept in checkpoints)."""
        self._checked = False  # this process has run an agreement check

    def state_dict(self) -> dict:
        return {"logprob_fallback": self.fallback}

    def load_state_dict(self, state: dict) -> None:
        self.fallback = bool(state["logprob_fallback"])

    def __call__(
        self, recompute: Recompute, batch: Batch, fresh: torch.Tensor, step: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
        """(old [N, T] or None, ref [N, T] or None, metrics) of step `step`'s batch;
        `fresh` [N] marks the rows sampled by the current policy (on-policy: compared).
        old None: the update takes them from its own forward (`update_usable`)."""
        cfg = self.cfg
        own = update_usable(cfg) and not self.fallback
        use_engine = (own or engine_usable(cfg)) and not self.fallback
        scheduled = step % cfg.learner.check_every == 0
        engine = batch.behaviour_logp * batch.response_mask
        kept, source = (None, "update") if own else (engine, "engine")
        none = {
            **mismatch_stats(engine, engine, torch.zeros_like(batch.response_mask)),
            "logprob_source": source,
            "logprob_check": None,
        }
        if use_engine and not scheduled and self._checked:
            return kept, None, none
        self._checked = True
        if use_engine:  # a check: some on-policy rows are enough (wrong weights show on all)
            rows = _check_rows(batch, fresh)
            sub = batch.rows(rows) if rows else batch
            old, ref = recompute(sub, own)
            stats = mismatch_stats(sub.behaviour_logp, old, sub.response_mask & bool(rows))
        else:
            old, ref = recompute(batch, own)
            stats = mismatch_stats(batch.behaviour_logp, old, batch.response_mask & fresh[:, None])
        worst = stats["logprob_mismatch_max"]
        exact = own or cfg.rollout.dtype == cfg.learner.dtype == "float32"
        bound = logprob_tolerance(cfg.rollout.temperature)
        agree = worst is None or worst <= bound
        if exact and not agree:
            self.log(
                f"warning: step {step + 1}: engine vs learner log-probs differ by {worst:.2e}, "
                f"above the stated bound {bound:.2e} (rl.algo.mismatch): check weights and "
                "dtype" + ("; recomputing the log-probs from now on" if use_engine else "")
            )
        if not use_engine:
            return old, ref, {**stats, "logprob_source": "learner", "logprob_check": None}
        if agree and not scheduled:  # this process's first step, checked off schedule:
            return kept, None, none  # recorded as the uninterrupted run records it
        if agree:  # checked: train as on the steps between checks (no reference: the
            # engine's are usable only without KL, and `ref` covers the checked rows only)
            return kept, None, {**stats, "logprob_source": source, "logprob_check": True}
        self.fallback = True  # from now on recomputed, in the learner's own dtype
        old, ref = recompute(batch, False)
        return old, ref, {**stats, "logprob_source": "learner", "logprob_check": False}
