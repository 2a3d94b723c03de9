"""Build a drafter from a short spec string (CLI and configs).

ngram                 n-gram / prompt lookup (model-free)
history               candidate trees from rollout history (model-free; `drafters.history`);
history:chain         the same, one path per iteration
draft:PATH            a smaller model (HF dir or .gguf) sharing the tokenizer
self                  the policy as its own draft (an oracle: acceptance 1, for checks)
eagle3:PATH           an EAGLE-3 head saved by specroll, SpecForge or for vLLM
mtp:PATH              MTP heads saved by specroll
history+eagle3:PATH   one tree per row from history and the EAGLE-3 head, each source
                      weighed by its running acceptance (`drafters.combined`); likewise
history+mtp:PATH      with MTP heads

A loaded draft network is placed on the target's device and in its dtype: the draft runs
in the engine's dtype, and hands the verifier fp32 q either way.
"""

from __future__ import annotations

from pathlib import Path

from specroll.drafters.base import Drafter
from specroll.model.transformer import Transformer

KINDS = (
    "ngram",
    "history",
    "history:chain",
    "draft:PATH",
    "self",
    "eagle3:PATH",
    "mtp:PATH",
    "history+eagle3:PATH",
    "history+mtp:PATH",
)

EXPECTED = {
    "eagle3": "a directory with config.json and *.safetensors: an EAGLE-3 head written by "
    "`specroll draft train`, SpecForge or for vLLM",
    "mtp": "a directory with config.json and mtp.safetensors written by "
    "`specroll draft train --kind mtp`",
}
"""What a PATH of each directory kind must be, for the error when it is not."""


def _draft_dir(kind: str, path: str, spec: str) -> Path:
    """`path` if it is a directory holding config.json, else a ValueError that names the
    path and says what was expected (the loaders would raise a bare FileNotFoundError)."""
    d = Path(path).expanduser()
    if not d.exists():
        problem = "does not exist"
    elif not d.is_dir():
        problem = "is not a directory"
    elif not (d / "config.json").is_file():
        problem = "has no config.json"
    else:
        return d
    raise ValueError(f"drafter {spec!r}: {d} {problem} (expected {EXPECTED[kind]})")


def _placed(module, target: Transformer):
    """`module` on `target`'s device and in its dtype (see `weights.for_inference`)."""
    from specroll.model.weights import for_inference

    p = next(target.parameters())
    return for_inference(module, p.device, p.dtype)


def build_drafter(spec: str, target: Transformer) -> Drafter:
    """Drafter for `spec` (see module docstring) on top of `target`."""
    kind, _, path = spec.partition(":")
    if kind in ("history+eagle3", "history+mtp") and path:
        from specroll.drafters.combined import CombinedDrafter
        from specroll.drafters.history import HistoryDrafter

        network = build_drafter(spec.removeprefix("history+"), target)
        return CombinedDrafter(HistoryDrafter(), network)
    if kind == "ngram" and not path:
        from specroll.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if kind == "history" and path in ("", "chain"):
        from specroll.drafters.history import HistoryConfig, HistoryDrafter

        return HistoryDrafter(HistoryConfig(chain=path == "chain"))
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
        return DraftModelDrafter(_placed(draft, target))
    if kind == "eagle3" and path:
        from specroll.drafters.eagle3 import Eagle3Drafter
        from specroll.drafters.eagle3_io import load_eagle3

        head = load_eagle3(_draft_dir(kind, path, spec), target.cfg, embed=target)
        return Eagle3Drafter(_placed(head, target))
    if kind == "mtp" and path:
        from specroll.drafters.mtp import MTPDrafter
        from specroll.drafters.mtp_io import load_mtp

        return MTPDrafter(_placed(load_mtp(_draft_dir(kind, path, spec), target), target))
    raise ValueError(f"drafter {spec!r} is not one of: {', '.join(KINDS)}")
