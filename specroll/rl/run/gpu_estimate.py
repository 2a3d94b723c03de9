"""The run report's simulated GPU figure: this run's measured acceptance fed to the
simulator for one H100 (`sim.run_on_gpu`), beside the speed-up measured here. Always
labelled simulated, never measured."""

from __future__ import annotations

from pathlib import Path

from specroll.rl.config import TrainConfig
from specroll.sim.run_on_gpu import GpuEstimate, policy_model, simulate_on_gpu


def simulated(out: Path, rows: list[dict], cfg: TrainConfig) -> GpuEstimate | str | None:
    """What this run's acceptance would give on one H100 (`sim.run_on_gpu`): the
    estimate, why there is none (the policy does not fit), or None (no acceptance)."""
    model = policy_model(out / "policy", cfg.policy.model)
    if model is None:
        return None
    try:
        return simulate_on_gpu(
            rows,
            model,
            max_batch=cfg.rollout.max_batch,
            draft_vocab=cfg.draft.draft_vocab_size or model.vocab,
            chain=not cfg.rollout.tree,
        )
    except ValueError as e:
        return f"no simulated GPU speed-up: {e}"


def with_simulated(summary: dict, est: GpuEstimate) -> dict:
    """The summary with the simulated figures right after the measured speed-ups."""
    keys = list(summary)
    at = max(
        (keys.index(k) + 1 for k in ("gen_speedup", "gen_rate_speedup") if k in summary),
        default=len(keys),
    )
    items = list(summary.items())
    return dict(items[:at] + list(est.summary().items()) + items[at:])
