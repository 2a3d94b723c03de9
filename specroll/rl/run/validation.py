"""The validation reward: one sample per validation prompt of the current policy, at fixed
seeds (`task.VALIDATION_SEED`), so that every validation of a run is comparable.

Its metrics are `val_accuracy`, the mean reward (an accuracy when rewards are 0 or 1, and
shown to users as the validation reward), and `val_accuracy/<source>` per data source when
the records name theirs (`data_source`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specroll.engine.request import Request, Results
from specroll.rl.run.task import VALIDATION_SEED, Task


@torch.no_grad()
def validate(
    task: Task, generate: Callable[[Sequence[Request]], Results], first: bool
) -> dict[str, float]:
    """{'val_accuracy': mean reward, 'val_accuracy/<source>': mean reward, ...}, NaN
    without validation problems. `first` (before the first step): a stop request ends
    the scoring at once (a resumed run validates again); after an update it finishes,
    so that the step's metrics are logged."""
    probs = task.validation()
    if not probs:
        return {"val_accuracy": float("nan")}
    results = generate(task.requests(probs, 1, VALIDATION_SEED))
    if first:
        rewards = task.score(probs, results, 1).total.view(-1)
    else:
        rewards = task.rewards(probs, results, 1).view(-1)
    out = {"val_accuracy": round(float(rewards.mean()), 4)}
    sources = [p.record.get("data_source") for p in probs]
    for src in sorted({str(x) for x in sources if x is not None}):
        mine = [i for i, x in enumerate(sources) if x is not None and str(x) == src]
        out[f"val_accuracy/{src}"] = round(float(rewards[mine].mean()), 4)
    return out
