"""MLflow logging (`log.mlflow`; needs `pip install specroll[mlflow]`).

Without `log.mlflow_uri` the tracking store is MLflow's file store in `out_dir/mlruns`
(`mlflow ui --backend-store-uri out_dir/mlruns` shows it). MLflow 3 keeps that store in
maintenance mode and refuses it unless `MLFLOW_ALLOW_FILE_STORE` is set, which is done
here for that default only. The config is logged as parameters (`section.field`) and as
`config.json`, each step's numbers as metrics at that step, the samples as
`samples/step-NNNNNN.json` artifacts. A resumed run continues the MLflow run whose
`specroll.run_id` tag is its id.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from specroll.rl.config import TrainConfig
from specroll.rl.run.logged import run_name, scalars

RUN_TAG = "specroll.run_id"
"""The tag that ties an MLflow run to the specroll run (its `run.json` id)."""


def tracking_uri(cfg: TrainConfig, out: Path) -> str:
    """`log.mlflow_uri`, or a file store in out/mlruns."""
    return cfg.log.mlflow_uri or (out / "mlruns").resolve().as_uri()


class MlflowLogger:
    """One MLflow run per specroll run, through a client of its own (no global state)."""

    def __init__(self, cfg: TrainConfig, out: Path, run_id: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if not cfg.log.mlflow_uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=tracking_uri(cfg, out))
        name = cfg.log.mlflow_experiment
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        found = self.client.search_runs([exp_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'")
        if found:
            self.run_id = found[0].info.run_id
            return
        run = self.client.create_run(exp_id, run_name=run_name(cfg), tags={RUN_TAG: run_id})
        self.run_id = run.info.run_id
        params = [
            Param(f"{sec}.{key}", str(value))
            for sec, fields in cfg.to_dict().items()
            for key, value in fields.items()
        ]
        self.client.log_batch(self.run_id, params=params)
        self.client.log_dict(self.run_id, cfg.to_dict(), "config.json")

    def step(self, m: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # '/' becomes '.': the file store keeps metric 'a/b' as a file under a directory
        # 'a', which cannot also be the file of metric 'a' (reward and reward/math)
        metrics = [Metric(k.replace("/", "."), v, now, m["step"]) for k, v in scalars(m).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def samples(self, step: int, rows: list[dict]) -> None:
        self.client.log_dict(self.run_id, rows, f"samples/step-{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
