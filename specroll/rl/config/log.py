"""The log section of a run's configuration: where metrics and samples go besides the run
directory."""

from __future__ import annotations

from dataclasses import dataclass

from specroll.rl.config.io import bound, check


@dataclass
class LogConfig:
    """Where metrics go."""

    tensorboard: bool = False
    """Also write TensorBoard events (needs the tensorboard package)."""
    wandb: bool = False
    """Also log to Weights & Biases (`pip install specroll[wandb]`; WANDB_MODE=offline
    writes the run under out_dir/wandb without a network)."""
    wandb_project: str = "specroll"
    """The W&B project."""
    mlflow: bool = False
    """Also log to MLflow (`pip install specroll[mlflow]`)."""
    mlflow_uri: str = ""
    """MLflow tracking URI; '' = a file store in out_dir/mlruns."""
    mlflow_experiment: str = "specroll"
    """The MLflow experiment."""
    run_name: str = ""
    """The run's name in W&B and MLflow; '' = the name of out_dir."""
    samples: int = 0
    """Completions per step written to out_dir/samples.jsonl (and the loggers): prompt,
    completion, reward, length, acceptance; the same ones for a step every time."""

    def __post_init__(self) -> None:
        bound("log", self, "samples", 0)
        check(
            not self.wandb or bool(self.wandb_project),
            "log.wandb_project must not be empty when log.wandb=true",
        )
