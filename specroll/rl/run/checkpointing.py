"""A training run's state on disk: what a checkpoint holds, writing it (in the
background between steps: `checkpoint.Writer`), and continuing from one.

`Checkpointing` is the base of `Trainer` (`rl/run/trainer.py`), whose config, learner
host, rollout backend and run directory it works on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from specroll.model.transformer import Transformer
from specroll.rl.algo.old_logprobs import OldLogprobs
from specroll.rl.config import TrainConfig
from specroll.rl.errors import CheckpointError
from specroll.rl.run import adapters, checkpoint, rundir


class Checkpointing:
    """Checkpoints of the run (`Trainer`'s base)."""

    cfg: TrainConfig
    policy: Transformer
    draft_config: dict | None
    host: Any
    """The learner host (`rl.learner`): its state, its sharded files."""
    rollout: Any
    """The rollout backend (`rl.rollout`): the drafter's state, the weights to publish."""
    step: int
    out: Path
    old_logprobs: OldLogprobs
    run_dir: rundir.RunDir | None
    writer: checkpoint.Writer
    log: Callable[[str], None]

    def checkpoint_state(self) -> dict:
        """What `state.pt` holds: the config, the old-log-prob source and the learner."""
        out = {
            "config": self.cfg.to_dict(),
            **self.old_logprobs.state_dict(),
            **self.host.checkpoint_state(),
        }
        if self.draft_config is not None:
            out["draft_config"] = self.draft_config
        if self.policy.lora_spec is not None:  # `policy` holds only the adapters
            out["lora_spec"] = adapters.spec_dict(self.policy.lora_spec)
        drafter = self.rollout.drafter_state()
        if drafter is not None:
            out["drafter"] = drafter
        return out

    def restore(self, state: dict) -> None:
        """Continue from a checkpoint's state (`checkpoint.load`)."""
        problem = rundir.config_mismatch(self.cfg.to_dict(), state["config"])
        if problem:
            raise ValueError(problem)
        self.host.restore(state)
        self.step = state["step"]
        self.old_logprobs.load_state_dict(state)
        self.rollout.update_weights(self.step, self.host.weights())
        if "drafter" in state:
            self.rollout.load_drafter_state(state["drafter"])

    def save_checkpoint(self, wait: bool = True) -> Path:
        """Checkpoint this step: written when this returns, or (`wait` False, between
        steps) in the background while the next step runs (`checkpoint.Writer`)."""
        path = self.writer.start(
            self.out / "checkpoints",
            self.step,
            self.checkpoint_state(),
            self.cfg.pipeline.keep_checkpoints,
            run_id=self.run_dir.run_id if self.run_dir is not None else "",
            write=self.host.save_sharded,
        )
        if wait:
            self.writer.wait()
        return path

    def _settle(self) -> None:
        """Wait for a checkpoint still being written (a run that ends on an error leaves
        one in flight); its failure is said, not raised over the error under way."""
        try:
            self.writer.wait()
        except CheckpointError as e:
            self.log(f"warning: {e}")

    def _kept(self) -> str:
        """Where the last good weights are after an update that was not applied."""
        if self.cfg.loss.updates_per_step == 1:  # the weights are those of the last step
            path = self.save_checkpoint()
            return f"the weights of step {self.step} are saved in {path}"
        newest = checkpoint.latest(self.out / "checkpoints")
        return "the newest checkpoint holds good weights" + (f": {newest}" if newest else "")
