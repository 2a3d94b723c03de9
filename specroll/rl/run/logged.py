"""What every logger (`loggers`) writes the same way: the run's name and a metrics row as
flat numbers. A leaf of the loggers, which import it (and `loggers` imports them)."""

from __future__ import annotations

import math
from pathlib import Path

from specroll.rl.config import TrainConfig


def run_name(cfg: TrainConfig) -> str:
    """`log.run_name`, or the name of the run's directory."""
    return cfg.log.run_name or Path(cfg.pipeline.out_dir).resolve().name


def scalars(m: dict) -> dict[str, float]:
    """The finite numbers of a metrics row, nested dicts flattened to `key/sub` (lists,
    strings, None and the step itself left out)."""
    out: dict[str, float] = {}
    for k, v in m.items():
        if k == "step":
            continue
        if isinstance(v, dict):
            for kk, vv in scalars(v).items():
                out[f"{k}/{kk}"] = vv
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out
