"""The draft a training run starts from (`draft.init`, `draft.kind`)."""

from __future__ import annotations

from pathlib import Path

import torch

from specroll.drafters.trainable import TrainableDraft, load_draft
from specroll.drafting.data import default_aux_layers
from specroll.drafting.default import default_draft
from specroll.drafting.train import new_eagle3, new_mtp
from specroll.model.transformer import Transformer
from specroll.rl.config import TrainConfig


def build_draft(
    cfg: TrainConfig, policy: Transformer, tok, policy_dir: Path, progress=None
) -> TrainableDraft | None:
    """The draft the run starts from (None when speculation and online training are off)."""
    if not cfg.rollout.speculative and not cfg.draft.online:
        return None
    init, kind = cfg.draft.init, cfg.draft.kind
    if init == "random":
        if kind == "mtp":
            return new_mtp(policy, cfg.pipeline.seed)
        g = torch.Generator().manual_seed(cfg.pipeline.seed)
        size = min(cfg.draft.draft_vocab_size, policy.cfg.vocab_size)
        vocab = torch.randperm(policy.cfg.vocab_size, generator=g)[:size].sort().values
        return new_eagle3(policy, vocab, default_aux_layers(policy), cfg.pipeline.seed)
    if init == "default":
        path = default_draft(policy, tok, policy_dir, progress=progress, kind=kind)
    else:
        path = Path(init)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"draft.init={init!r}: expected 'default', 'random' or a draft directory"
            )
    return load_draft(path, policy)
