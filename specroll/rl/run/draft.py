"""The draft a training run starts from (`draft.init`, of the kind `rollout.drafter` names)."""

from __future__ import annotations

from pathlib import Path

import torch

from specroll.drafting.default import DefaultDraftRecipe, cached_draft, default_draft
from specroll.drafting.fresh import PROMPT_TOKENS, STARTS, fresh_draft
from specroll.drafting.trainable import TrainableDraft, load_draft
from specroll.model.transformer import Transformer
from specroll.rl.config import TrainConfig
from specroll.rl.config.draft import INITS
from specroll.rl.run.task import math_problems, prompt_ids, task_files

TASK_PROMPTS_SEED = 0
"""Seed of the order a data file's training prompts are sampled in for the default draft
(fixed, not the run's seed: another seed reuses the same cached draft)."""
TASK_PROMPTS_USED = max(DefaultDraftRecipe().data.n, PROMPT_TOKENS)
"""The most prompts a draft's start reads (an offline draft samples `data.n`, a fresh
one's vocabulary at most one prompt per `PROMPT_TOKENS`): the rest of a large file is
never encoded (a million records would take minutes of chat templates)."""


BOOTSTRAP = "policy"
"""What `draft.init: auto` starts from when no in-domain draft of this policy is cached
(measured: README, issue 47)."""
STARTED = {"policy": "the policy's weights", "random": "random weights"}
"""How the log names each start."""
MATH_PROMPTS = 64
"""Procedural math prompts an EAGLE-3 draft started without sampling reads its vocabulary
from (`drafting.fresh.prompt_vocab`)."""


def math_prompts(cfg: TrainConfig, tok) -> list[list[int]]:
    """The run's first procedural math prompts, encoded as its requests are."""
    problems = math_problems(MATH_PROMPTS, cfg.pipeline.seed, cfg.data.levels)
    return [prompt_ids(cfg, tok, p) for p in problems]


def task_prompts(cfg: TrainConfig, tok) -> list[list[int]] | None:
    """A data-file task's training prompts (validation records left out), encoded as the
    run's requests are, in a fixed shuffled order (a file sorted by source or difficulty
    still gives the draft a mix when it holds more prompts than the draft samples); None
    for the procedural math task."""
    train = task_files(cfg).training(cfg.data.val_size)
    if train is None:
        return None
    g = torch.Generator().manual_seed(TASK_PROMPTS_SEED)
    order = torch.randperm(len(train), generator=g)[:TASK_PROMPTS_USED]
    return [prompt_ids(cfg, tok, train[int(i)]) for i in order]


def build_draft(
    cfg: TrainConfig, policy: Transformer, tok, policy_dir: Path, progress=None, log=None
) -> TrainableDraft | None:
    """The draft the run starts from (None when speculation and online training are off,
    or when the drafter has no network, history: none to build, train or ship); `log`
    (a str callback) hears which start `draft.init: auto` took."""
    kind = cfg.rollout.network
    if kind is None or (not cfg.rollout.speculative and not cfg.draft.online):
        return None
    init = cfg.draft.init
    named = init in INITS  # (a draft directory needs no prompts)
    prompts = task_prompts(cfg, tok) if named else None  # None: the procedural math set
    if init == "auto":
        path = cached_draft(policy_dir, kind, prompts)
        init = str(path) if path is not None else BOOTSTRAP
        if log is not None:
            log(
                f"draft: the in-domain {kind} draft cached at {path}"
                if path is not None
                else f"draft: a fresh {kind} draft started from {STARTED[BOOTSTRAP]}, trained "
                "online (no in-domain draft cached; `--set draft.init=offline` builds one)"
            )
    if init in STARTS:
        own = prompts or math_prompts(cfg, tok)
        return fresh_draft(init, kind, policy, own, cfg.pipeline.seed, cfg.draft.draft_vocab_size)
    if init == "offline":
        # in-domain: sampled on the run's own training prompts (the math set, or its file's)
        path = default_draft(policy, tok, policy_dir, progress=progress, kind=kind, prompts=prompts)
    else:
        path = Path(init)
        if not (path / "config.json").exists():
            raise ValueError(f"draft.init={init!r}: expected one of {INITS} or a draft directory")
    try:
        draft = load_draft(path, policy)
    except ValueError as e:  # the file and field it names, and the setting that chose it
        raise ValueError(f"draft.init={str(path)!r}: {e}") from None
    if draft.kind != kind:
        raise ValueError(
            f"draft.init={init!r} holds a {draft.kind} draft but rollout.drafter="
            f"{cfg.rollout.drafter} drafts with {kind}: set rollout.drafter to name {draft.kind}"
        )
    return draft
