"""The draft a training run starts from (`draft.init`, of the kind `rollout.drafter` names)."""

from __future__ import annotations

from pathlib import Path

import torch

from specroll.drafting.data import default_aux_layers
from specroll.drafting.default import default_draft
from specroll.drafting.train import new_eagle3, new_mtp
from specroll.drafting.trainable import TrainableDraft, load_draft
from specroll.model.transformer import Transformer
from specroll.rl.config import TrainConfig
from specroll.rl.run.task import prompt_ids, task_files

TASK_PROMPTS_SEED = 0
"""Seed of the order a data file's training prompts are sampled in for the default draft
(fixed, not the run's seed: another seed reuses the same cached draft)."""


def task_prompts(cfg: TrainConfig, tok) -> list[list[int]] | None:
    """A data-file task's training prompts (validation records left out), encoded as the
    run's requests are, in a fixed shuffled order (a file sorted by source or difficulty
    still gives the draft a mix when it holds more prompts than the draft samples); None
    for the procedural math task."""
    train = task_files(cfg).training(cfg.data.val_size)
    if train is None:
        return None
    g = torch.Generator().manual_seed(TASK_PROMPTS_SEED)
    return [prompt_ids(cfg, tok, train[int(i)]) for i in torch.randperm(len(train), generator=g)]


def build_draft(
    cfg: TrainConfig, policy: Transformer, tok, policy_dir: Path, progress=None
) -> TrainableDraft | None:
    """The draft the run starts from (None when speculation and online training are off,
    or when the drafter has no network, history: none to build, train or ship)."""
    kind = cfg.rollout.network
    if kind is None or (not cfg.rollout.speculative and not cfg.draft.online):
        return None
    init = cfg.draft.init
    if init == "random":
        if kind == "mtp":
            return new_mtp(policy, cfg.pipeline.seed)
        g = torch.Generator().manual_seed(cfg.pipeline.seed)
        size = min(cfg.draft.draft_vocab_size, policy.cfg.vocab_size)
        vocab = torch.randperm(policy.cfg.vocab_size, generator=g)[:size].sort().values
        return new_eagle3(policy, vocab, default_aux_layers(policy), cfg.pipeline.seed)
    if init == "default":
        # in-domain: sampled on the run's own training prompts (the math set, or its file's)
        prompts = task_prompts(cfg, tok)
        path = default_draft(policy, tok, policy_dir, progress=progress, kind=kind, prompts=prompts)
    else:
        path = Path(init)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"draft.init={init!r}: expected 'default', 'random' or a draft directory"
            )
    draft = load_draft(path, policy)
    if draft.kind != kind:
        raise ValueError(
            f"draft.init={init!r} holds a {draft.kind} draft but rollout.drafter="
            f"{cfg.rollout.drafter} drafts with {kind}: set rollout.drafter to name {draft.kind}"
        )
    return draft
