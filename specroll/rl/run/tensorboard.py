"""TensorBoard logging of the step metrics (optional: needs the tensorboard package)."""

from __future__ import annotations

from pathlib import Path


def writer(out: Path):
    """A TensorBoard writer under out/tb (log.tensorboard=true)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ValueError("log.tensorboard=true needs the tensorboard package installed") from e
    return SummaryWriter(str(out / "tb"))


def write(writer, m: dict) -> None:
    """One step's numeric metrics (dicts as name/key scalars)."""
    for k, v in m.items():
        if isinstance(v, (int, float)) and k != "step":
            writer.add_scalar(k, v, m["step"])
        elif isinstance(v, dict):
            for kk, vv in v.items():
                writer.add_scalar(f"{k}/{kk}", vv, m["step"])
