"""Weights & Biases logging (`log.wandb`; needs `pip install specroll[wandb]`).

The W&B run's files go under the run directory (`out_dir/wandb/`): with `WANDB_MODE=offline`
nothing leaves the machine and `wandb sync out_dir/wandb/offline-run-*` uploads it later.
The run's id is the specroll run's, so a resumed run continues the same W&B run.
"""

from __future__ import annotations

from pathlib import Path

from specroll.rl.config import TrainConfig
from specroll.rl.run.logged import run_name, scalars

COLUMNS = (
    "step",
    "index",
    "prompt",
    "completion",
    "reward",
    "length",
    "finish_reason",
    "drafted",
    "accepted",
)
"""The columns of the per-step samples table (reward components are added as they come)."""


class WandbLogger:
    """Config at start, every number of a step at that step, the samples as a table."""

    def __init__(self, cfg: TrainConfig, out: Path, run_id: str) -> None:
        import wandb

        self.wandb = wandb
        out.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.log.wandb_project,
            name=run_name(cfg),
            id=run_id or None,
            resume="allow",
            dir=str(out),
            config=cfg.to_dict(),
            # the trainer's console lines stay as they are; metrics are logged explicitly
            settings=wandb.Settings(console="off", silent=True),
        )

    def step(self, m: dict) -> None:
        self.run.log(scalars(m), step=m["step"])

    def samples(self, step: int, rows: list[dict]) -> None:
        parts = sorted({k for r in rows for k in r.get("reward_components", {})})
        columns = [*COLUMNS, *(f"reward/{p}" for p in parts)]
        data = [
            [r.get(c) for c in COLUMNS] + [r.get("reward_components", {}).get(p) for p in parts]
            for r in rows
        ]
        self.run.log({"samples": self.wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()
