"""Where a run's step metrics and sample completions go besides its own files: TensorBoard,
Weights & Biases and MLflow, each optional (`log.tensorboard`, `log.wandb`, `log.mlflow`).

`metrics.jsonl` and `samples.jsonl` in the run directory are the record; a logger is a
copy for dashboards. Each one gets the same three calls from the trainer (`Logger`), so
adding a service is one class here and one entry in `EXTRAS`. Their packages are extras:
`check_installed` runs before any model is loaded (the CLI's plan, and `Trainer.__init__`)
so a missing one fails in a second, naming what to install, not after the model loaded.

A resumed run logs to the same W&B run (its id is the run's id) and the same MLflow run
(found by its `specroll.run_id` tag); the steps it redoes are logged again.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Protocol

from specroll.rl.config import TrainConfig

EXTRAS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
"""`log.<setting>` -> (the module it imports, the specroll extra that installs it)."""


class Logger(Protocol):
    """One logging service: step metrics and sample rows, in step order."""

    def step(self, m: dict) -> None:
        """A step's metrics (`report.step_metrics`, with `step`)."""

    def samples(self, step: int, rows: list[dict]) -> None:
        """The sample completions of `step` (`samples.rows`)."""

    def close(self) -> None:
        """Flush and end the run on the service."""


def check_installed(cfg: TrainConfig) -> None:
    """ValueError naming the setting and the extra to install for every logger that is on
    but whose package is missing."""
    for name, (module, extra) in EXTRAS.items():
        if getattr(cfg.log, name) and importlib.util.find_spec(module) is None:
            raise ValueError(
                f"log.{name}=true needs the {module} package: pip install 'specroll[{extra}]' "
                f"(or set log.{name}=false)"
            )


class Loggers:
    """The loggers a run has switched on, called together."""

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = loggers

    def step(self, m: dict) -> None:
        for lg in self.loggers:
            lg.step(m)

    def samples(self, step: int, rows: list[dict]) -> None:
        if rows:
            for lg in self.loggers:
                lg.samples(step, rows)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def open_loggers(cfg: TrainConfig, out: Path, run_id: str) -> Loggers:
    """The loggers `cfg.log` asks for, started for the run `run_id` writing into `out`."""
    check_installed(cfg)
    found: list[Logger] = []
    if cfg.log.tensorboard:
        from specroll.rl.run.tensorboard import TensorBoardLogger

        found.append(TensorBoardLogger(out))
    if cfg.log.wandb:
        from specroll.rl.run.wandb_logger import WandbLogger

        found.append(WandbLogger(cfg, out, run_id))
    if cfg.log.mlflow:
        from specroll.rl.run.mlflow_logger import MlflowLogger

        found.append(MlflowLogger(cfg, out, run_id))
    return Loggers(found)
