"""Build a drafter from a short spec string (CLI and configs).

ngram                 n-gram / prompt lookup (model-free)
draft:PATH            a smaller model (HF dir or .gguf) sharing the tokenizer
self                  the policy as its own draft (an oracle: acceptance 1, for checks)
eagle3:PATH           an EAGLE-3 head saved by specroll, SpecForge or for vLLM
mtp:PATH              MTP heads saved by specroll
"""

from __future__ import annotations

from specroll.drafters.base import Drafter
from specroll.model.transformer import Transformer

KINDS = ("ngram", "draft:PATH", "self", "eagle3:PATH", "mtp:PATH")


def build_drafter(spec: str, target: Transformer) -> Drafter:
    """Drafter for `spec` (see module docstring) on top of `target`."""
    kind, _, path = spec.partition(":")
    if kind == "ngram" and not path:
        from specroll.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if kind == "self" and not path:
        from specroll.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter(target)
    if kind == "draft" and path:
        from specroll.drafters.draft_model import DraftModelDrafter
        from specroll.model.hub import resolve
        from specroll.model.weights import load_model

        draft = load_model(resolve(path))
        if draft.cfg.vocab_size != target.cfg.vocab_size:
            raise ValueError(
                f"draft model vocab_size={draft.cfg.vocab_size} differs from the policy's "
                f"{target.cfg.vocab_size}: they must share a tokenizer"
            )
        return DraftModelDrafter(draft)
    if kind == "eagle3" and path:
        from specroll.drafters.eagle3 import Eagle3Drafter, load_eagle3

        return Eagle3Drafter(load_eagle3(path, target.cfg, embed=target))
    if kind == "mtp" and path:
        from specroll.drafters.mtp import MTPDrafter, load_mtp

        return MTPDrafter(load_mtp(path, target))
    raise ValueError(f"drafter {spec!r} is not one of: {', '.join(KINDS)}")
