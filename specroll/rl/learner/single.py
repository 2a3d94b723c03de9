"""The learner in this process (`learner.strategy: single`, `learner.placement: local`)."""

from __future__ import annotations

from pathlib import Path

import torch

from specroll.drafting.trainable import TrainableDraft, save_draft
from specroll.model import lora, peft_io
from specroll.model.transformer import Transformer
from specroll.model.weights import load_state, save_model
from specroll.rl.algo.batch import Batch
from specroll.rl.config import TrainConfig
from specroll.rl.learner.build import build_learner
from specroll.rl.learner.fsdp import dcp
from specroll.rl.replica import Weights, to_cpu


class LocalLearnerHost:
    """The learner in this process, on the policy and draft objects the caller built
    (moved to `learner.device`)."""

    def __init__(
        self,
        cfg: TrainConfig,
        policy: Transformer,
        draft: TrainableDraft | None,
        device: torch.device | None = None,
    ) -> None:
        self.policy, self.draft = policy, draft
        self.model = cfg.policy.model
        self.learner = build_learner(cfg, policy, draft, device)

    def logprobs(
        self, batch: Batch, exact: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        lr = self.learner
        return lr.logprobs(batch, exact=exact), lr.reference_logprobs(batch)

    def train(
        self, batch: Batch, old: torch.Tensor, ref: torch.Tensor | None, lr: float | None = None
    ) -> dict:
        return self.learner.train(batch, old, ref, lr=lr)

    def weights(self) -> Weights:
        """The policy's and the draft's tensors (views on the learner's device: the
        rollout side copies them into its own)."""
        return Weights.of(self.policy, self.draft)

    def checkpoint_state(self) -> dict:
        """Weights and optimizer states, on the CPU (on a CPU learner these are the
        tensors themselves, not copies)."""
        out = {"policy": _policy_state(self.policy), "policy_opt": self.learner.opt.state_dict()}
        if self.draft is not None:
            out["draft"] = self.draft.state_dict()
        if self.learner.draft_opt is not None:
            out["draft_opt"] = self.learner.draft_opt.state_dict()
        return to_cpu(out)

    def save_sharded(self, ckpt_dir: Path) -> None:
        """Nothing: the whole state is in `checkpoint_state`."""

    def restore(self, state: dict) -> None:
        """Load a checkpoint written on any device: weights are copied into the learner's
        tensors, and each optimizer moves its state onto its parameters' device. A
        sharded checkpoint (`learner.strategy: fsdp`, any rank count) is read with DCP."""
        if "policy" not in state:
            dcp.load(self.learner, self.draft, Path(state["path"]) / "learner")
            return
        adapted = self.policy.lora_spec is not None
        if adapted and set(state["policy"]) != set(lora.adapters(self.policy)):
            raise ValueError("the checkpoint's policy is not this run's adapters (lora.* differ)")
        load_state(self.policy, state["policy"], "the checkpoint's policy", partial=adapted)
        if self.draft is not None:
            load_state(self.draft, state["draft"], "the checkpoint's draft")
        self.learner.opt.load_state_dict(state["policy_opt"])
        if self.learner.draft_opt is not None:
            self.learner.draft_opt.load_state_dict(state["draft_opt"])

    def export(self, out: Path) -> None:
        """The final policy/ (adapters merged), adapter/ (PEFT, a LoRA policy's), draft/."""
        save_model(self.policy, out / "policy")
        if self.policy.lora_spec is not None:
            peft_io.save(self.policy, out / "adapter", peft_io.base_of(self.model))
        if self.draft is not None:
            save_draft(self.draft, out / "draft")

    def close(self) -> None:
        pass


def _policy_state(policy: Transformer) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of the policy: a LoRA policy's adapters (its base is the
    run's policy.model, loaded again on resume), else every weight."""
    return lora.adapters(policy) if policy.lora_spec is not None else policy.state_dict()
