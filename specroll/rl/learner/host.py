"""The learner host interface: what the trainer asks of the learner wherever it runs.

A host answers the same verbs in one process (`single`), in a Ray actor (`ray`) or over N
FSDP ranks (`fsdp`): the log-probs of a batch under the policy and the reference, an
update, the weights to publish, the state of a checkpoint (`checkpoint_state`, and
`save_sharded` for what ranks write themselves: a no-op elsewhere), `restore`, `export`
and `close`.

Devices at the seams: batches and old log-probs arrive on the CPU (the learner moves
them), log-probs leave on the CPU, `weights()` may be on the learner's device (the
rollout side copies them into its own tensors), and `checkpoint_state()` is on the CPU,
so that a checkpoint written by a GPU learner loads on a machine without one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from specroll.rl.algo.batch import Batch
from specroll.rl.replica import Weights


@runtime_checkable
class LearnerHost(Protocol):
    """Where the learner runs; every method is a whole stage of the step."""

    def logprobs(
        self, batch: Batch, exact: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[N, T] log-probs (CPU, fp32) of the batch under the policy and (if any) the
        reference (stage `logprob`); `exact`: computed in fp32 whatever `learner.dtype`
        (a bf16 learner's check against an fp32 engine, `algo.old_logprobs`)."""

    def train(
        self, batch: Batch, old: torch.Tensor, ref: torch.Tensor | None, lr: float | None = None
    ) -> dict:
        """One update (stage `train`) at learning rate `lr` (None: the optimizer's own);
        its statistics as floats."""

    def weights(self) -> Weights:
        """The weights to publish to the rollout side (stage `prepare`)."""

    def checkpoint_state(self) -> dict:
        """What a checkpoint's `state.pt` holds of the learner (CPU tensors)."""

    def save_sharded(self, ckpt_dir: Path) -> None:
        """Write what the learner's ranks save themselves into `ckpt_dir` (a no-op for a
        learner whose whole state is in `checkpoint_state`)."""

    def restore(self, state: dict) -> None:
        """Load a checkpoint (`state`: its `state.pt`, and `path`: its directory)."""

    def export(self, out: Path) -> None:
        """The trained policy (HF directory `out/policy`) and draft (`out/draft`)."""

    def close(self) -> None:
        """Stop the learner's processes or actors."""
