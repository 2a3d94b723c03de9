"""Building the learner of a run from its config: where it computes, and what it holds."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch

from specroll.device import learner_dtype, resolve_device, resolve_dtype
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


def with_learner_dtype(cfg: TrainConfig, log: Callable[[str], None] = print) -> TrainConfig:
    """`cfg` with `learner.dtype: auto` made concrete for the learner's device here (bf16
    where its products measure clearly faster: `device.learner_dtype`), said in the
    log; any other value unchanged. Resolved once, in the driver, so that every learner
    rank and the old log-probs' source see the same dtype."""
    if cfg.learner.dtype != "auto":
        return cfg
    if cfg.learner_placement() == "ray" and cfg.ray.learner_gpus > 0:
        name, why = "float32", "the learner's GPU is a Ray actor's, not measurable here"
    else:
        gpu = False if cfg.learner_placement() == "ray" else None
        from specroll.model.hub import home

        device = learner_device(cfg.learner, gpu_assigned=gpu)
        name, why = learner_dtype(device, home() / "capability.json")
    log(f"learner.dtype auto: {name} ({why})")
    return dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, dtype=name))


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
    cfg = with_learner_dtype(cfg, lambda m: None)  # (a Trainer resolved it already)
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
