"""TensorBoard logging of the step metrics (optional: needs the tensorboard package)."""

from __future__ import annotations

import json
from pathlib import Path

from specroll.rl.run.logged import scalars


class TensorBoardLogger:
    """Events under out/tb (log.tensorboard=true): every number of a step as a scalar,
    the samples as text."""

    def __init__(self, out: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ValueError(
                "log.tensorboard=true needs the tensorboard package: "
                "pip install 'specroll[tensorboard]'"
            ) from e
        self.writer = SummaryWriter(str(out / "tb"))

    def step(self, m: dict) -> None:
        for k, v in scalars(m).items():
            self.writer.add_scalar(k, v, m["step"])

    def samples(self, step: int, rows: list[dict]) -> None:
        text = "\n\n".join(f"    {json.dumps(r, ensure_ascii=False)}" for r in rows)
        self.writer.add_text("samples", text, step)

    def close(self) -> None:
        self.writer.close()
