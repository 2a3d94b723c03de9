"""Building the learner of a run from its config: where it computes, and what it holds."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from specroll.device import resolve_device, resolve_dtype
from specroll.drafting.trainable import TrainableDraft
from specroll.model.transformer import Transformer
from specroll.rl.config import LearnerConfig, TrainConfig
from specroll.rl.learner.learner import Learner


def learner_device(cfg: LearnerConfig, rank: int = 0, gpu_assigned: bool | None = None):
    """`learner.device` for learner rank `rank`: 'auto' is a GPU when this process has one
    (`gpu_assigned`: Ray's answer for an actor, else whether torch sees one), else the CPU;
    'cuda' without an index is this rank's GPU."""
    name = cfg.device
    if name == "auto":
        has_gpu = torch.cuda.is_available() if gpu_assigned is None else gpu_assigned
        name = "cuda" if has_gpu else "cpu"
    if name == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return resolve_device(name, "learner.device")


def build_learner(
    cfg: TrainConfig,
    policy: Transformer,
    draft: TrainableDraft | None,
    device: torch.device | None = None,
    prepare: Callable[[Transformer], None] | None = None,
) -> Learner:
    """The Learner of a run: policy (+ reference copy when KL is on) + online draft, on
    `device` (default: `learner_device`) in `learner.dtype`.

    prepare: applied to the policy and the reference before the optimizer is made (an
    FSDP rank shards them there: the optimizer must step the shards)."""
    if device is None:
        device = learner_device(cfg.learner)
    reference = None
    # fresh adapters start at zero: the reference (the initial policy) is the base, the
    # policy itself with its adapters off (`lora.disabled`), not a copy of it
    base_reference = cfg.loss.kl_coef > 0 and policy.lora_spec is not None and not cfg.lora.init
    if cfg.loss.kl_coef > 0 and not base_reference:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    if prepare is not None:
        for model in (reference, policy):
            if model is not None:
                prepare(model)
    return Learner(
        policy,
        policy_cfg=cfg.policy,
        loss_cfg=cfg.loss,
        rollout_cfg=cfg.rollout,
        draft=draft,
        draft_cfg=cfg.draft,
        reference=reference,
        base_reference=base_reference,
        decoupled=cfg.pipeline.max_lag > 0,
        device=device,
        dtype=resolve_dtype(cfg.learner.dtype, "learner.dtype"),
    )
