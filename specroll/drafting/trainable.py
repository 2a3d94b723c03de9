"""The trainable-draft protocol: what offline training, online co-training and the RL loop
need of a draft network, whatever its architecture.

EAGLE-3 (`Eagle3Head`) and MTP (`MTPDraft`) both implement it with identical signatures,
so `specroll.drafting` and `specroll.rl` name only `TrainableDraft` and the functions
below, and a new architecture is one class that implements it plus one entry in `NETWORKS`.

A draft reads two kinds of policy state (both detached, never a path for gradients into
the policy): `aux`, the residual-stream states after the layers in `aux_layers`
concatenated on the last axis (EAGLE-3 fuses three of them), and `final`, the policy's
last state after its final norm (MTP's input; the policy's logits are `final @ W`).

Vocabulary: a *draft* is the network (`TrainableDraft`: `Eagle3Head`, `MTPDraft`); a
*drafter* is what the engine calls to propose tokens (`specroll.drafters.base.Drafter`),
built from a draft by `draft.drafter()` or by name by `drafting.registry`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from specroll.drafting.eagle3_head import Eagle3Head
from specroll.drafting.eagle3_io import config_from_hf, load_eagle3, save_eagle3
from specroll.drafting.mtp_heads import MTPConfig, MTPDraft
from specroll.drafting.mtp_io import load_mtp, save_mtp

if TYPE_CHECKING:
    from specroll.drafters.base import Drafter
    from specroll.drafting.ttt import Unroll
    from specroll.model.transformer import Transformer


NETWORKS = ("eagle3", "mtp")
"""Trainable draft architectures: the networks a run trains online and ships (each a
drafter name of `drafting.registry`)."""


@runtime_checkable
class TrainableDraft(Protocol):
    """A draft network on top of a policy it references (embedding, and for MTP the LM
    head and final norm), never copies or trains."""

    kind: str
    """One of NETWORKS."""
    cfg: Any
    """Its architecture; `type(draft)(draft.cfg, policy)` builds an untrained twin."""

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Residual-stream states the draft reads as `aux` (in this order; may be empty)."""

    @property
    def reads_final(self) -> bool:
        """Whether the draft reads `final` (the policy's normed last state)."""

    @property
    def vocab(self) -> torch.Tensor | None:
        """[V'] target ids of the draft's output vocabulary, ascending (None: all)."""

    @property
    def kv_group(self) -> int:
        """Query heads per KV head of the draft's attention (for the TTT key chain)."""

    def features(self, aux: torch.Tensor, final: torch.Tensor | None) -> torch.Tensor:
        """aux [B, T, len(aux_layers) H], final [B, T, H] or None -> input states [B, T, H]."""

    def step(self, tokens: torch.Tensor, states: torch.Tensor, unroll: Unroll) -> Any:
        """One training-time-test step (`specroll.drafting.ttt`): tokens [B, T], states
        [B, T, H] -> (logits, next states [B, T, H])."""

    def readout(self, state: torch.Tensor) -> torch.Tensor:
        """States [..., H] -> logits [..., V'] over `vocab`."""

    def drafter(self, version: int = 0) -> Drafter:
        """A proposer for the engine on this network (weights shared, not copied)."""

    def for_training(self) -> TrainableDraft:
        """Make forwards differentiable through the parameters (no prepacked copies)."""


def save_draft(draft: TrainableDraft, out_dir: str | Path) -> None:
    """Write `draft` in its serving layout into out_dir (loadable by `load_draft`): EAGLE-3
    as config.json + model.safetensors (vLLM's layout), MTP as config.json +
    mtp.safetensors."""
    if draft.kind == "eagle3":
        save_eagle3(draft, out_dir)
    elif draft.kind == "mtp":
        save_mtp(draft, out_dir)
    else:
        raise ValueError(f"unknown draft kind {draft.kind!r}; expected one of {NETWORKS}")


def draft_config(draft: TrainableDraft) -> dict[str, Any]:
    """The draft's architecture as the config.json `save_draft` writes (plain JSON values:
    a checkpoint stores it, so that `new_draft` can rebuild the network from it)."""
    return draft.cfg.to_hf() if draft.kind == "eagle3" else draft.cfg.to_dict()


def new_draft(kind: str, config: dict[str, Any], policy: Transformer) -> TrainableDraft:
    """An untrained draft of `kind` with the architecture `config` (`draft_config`), on
    `policy`; its weights are for the caller to fill."""
    if kind == "eagle3":
        return Eagle3Head(config_from_hf(config, policy.cfg), embed=policy)
    if kind == "mtp":
        return MTPDraft(MTPConfig(**config), policy)
    raise ValueError(f"unknown draft kind {kind!r}; expected one of {NETWORKS}")


def load_draft(path: str | Path, policy: Transformer) -> TrainableDraft:
    """A draft saved by `save_draft` (EAGLE-3 also in SpecForge / vLLM layout)."""
    p = Path(path)
    if (p / "mtp.safetensors").is_file():
        return load_mtp(p, policy)
    return load_eagle3(p, policy.cfg, embed=policy)
