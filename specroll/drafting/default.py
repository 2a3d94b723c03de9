"""The in-domain draft of a policy (EAGLE-3 by default, or MTP), built once and cached.

`specroll train` needs a draft before its first speculative rollout. Following the
paper's finding (§1.4: a draft initialised on the policy's own in-domain outputs accepts
clearly more than a generic one), it samples the policy on the RL task's prompts at the
RL temperature, trains an EAGLE-3 head on those samples with TTT, and caches the result
under $SPECROLL_HOME/drafts/<key>, where the key hashes the policy's weights file and
every setting below: a changed policy or recipe builds a new draft, an unchanged one is
loaded in seconds. The task's prompts are the procedural math set, or a data file's
training prompts (`prompts`, given encoded): then their digest is in the key too, so a
draft built for one data set is never loaded for another. Both stages resume after an
interruption (data shards, trainer checkpoints). The recipe is sized for the embedded
default on a 2-core CPU (23 minutes measured on a quiet 2-core Zen 5: 10.6 sampling, 12.3
training; 8 epochs accept 0.356 at the first draft position against 0.334 for 6, on 160
held-out prompts); larger policies on GPUs would raise `n` and `epochs`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specroll.drafting.data import DraftData, DraftDataConfig, collect, prompt_ids
from specroll.drafting.train import DraftTrainConfig, train_draft
from specroll.model.hub import home
from specroll.model.transformer import Transformer


@dataclass
class DefaultDraftRecipe:
    """Data and training settings of the cached in-domain draft."""

    data: DraftDataConfig = field(default_factory=lambda: DraftDataConfig(n=1024, shard_size=128))
    """Policy samples to train on (prompt set = the RL task's)."""
    train: DraftTrainConfig = field(
        default_factory=lambda: DraftTrainConfig(epochs=8, ttt_steps=3, lr=3e-3, eval_frac=0.03)
    )
    """EAGLE-3 training settings."""


def _key(policy_dir: Path, recipe: DefaultDraftRecipe) -> str:
    h = hashlib.sha256(json.dumps(asdict(recipe), sort_keys=True).encode())
    for f in sorted(policy_dir.glob("*.safetensors")) + [policy_dir / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{int(st.st_mtime)}".encode())
    return h.hexdigest()[:12]


def _place(
    policy_dir: str | Path,
    recipe: DefaultDraftRecipe | None,
    kind: str,
    prompts: list[list[int]] | None,
) -> tuple[DefaultDraftRecipe, Path]:
    """The recipe for `kind` on `prompts`, and the cache directory its draft lives in."""
    recipe = recipe or DefaultDraftRecipe()
    recipe = replace(recipe, train=replace(recipe.train, kind=kind))
    if prompts is not None:
        if not prompts:
            raise ValueError("default_draft: prompts is empty (None = the recipe's prompt set)")
        # the prompts' digest names the set, in the key and in the data's meta.json
        digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:12]
        recipe = replace(recipe, data=replace(recipe.data, prompts=f"task-{digest}"))
    policy_dir = Path(policy_dir)
    return recipe, home() / "drafts" / f"{policy_dir.name}-{kind}-{_key(policy_dir, recipe)}"


def cached_draft(
    policy_dir: str | Path, kind: str = "eagle3", prompts: list[list[int]] | None = None
) -> Path | None:
    """The directory of `default_draft`'s draft if it is already built, else None (nothing
    is built: `draft.init: auto` takes it when present and starts at once when not)."""
    if not (Path(policy_dir) / "config.json").is_file():  # not a model directory: none built
        return None
    final = _place(policy_dir, None, kind, prompts)[1] / "draft"
    return final if (final / "config.json").is_file() else None


def default_draft(
    policy: Transformer,
    tok,
    policy_dir: str | Path,
    recipe: DefaultDraftRecipe | None = None,
    progress: Callable[..., None] | None = None,
    kind: str = "eagle3",
    prompts: list[list[int]] | None = None,
) -> Path:
    """Directory of the cached draft of architecture `kind` for `policy` (built on first
    use), sampled on `prompts` (token ids, cycled to the recipe's n) or, when None, on
    the recipe's own prompt set.

    progress(stage, done, total, info) is called with stage 'data' (rollouts) and
    'train' (optimizer steps; info: the loss and per-position acceptance).
    """
    recipe, root = _place(policy_dir, recipe, kind, prompts)
    final = root / "draft"
    if (final / "config.json").is_file():
        return final
    data_dir = root / "data"

    def on_data(done: int, total: int) -> None:
        if progress:
            progress("data", done, total)

    if prompts is None:
        ids = prompt_ids(tok, recipe.data)
    else:
        ids = [prompts[i % len(prompts)] for i in range(recipe.data.n)]
    collect(
        policy,
        ids,
        str(policy_dir),
        recipe.data,
        data_dir,
        progress=on_data,
    )

    def on_step(rec: dict) -> None:
        if progress:
            acc = " ".join(f"{a:.2f}" for a in rec["accept"])
            progress("train", rec["step"], rec["total"], f"loss {rec['loss']:.3f}, accept {acc}")

    if progress:
        progress("train", 0, None)  # the stage shows from its start, not its first step
    work = root / "training"
    train_draft(policy, DraftData(data_dir), recipe.train, work, resume=True, log=on_step)
    work.rename(final)
    shutil.rmtree(data_dir, ignore_errors=True)  # features are large; the draft is what counts
    return final
