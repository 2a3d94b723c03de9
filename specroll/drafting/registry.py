"""Every drafter by name: one vocabulary for the command line (`--drafter`), the run's
`rollout.drafter` and its `pipeline.shadow_drafters`, and one place that builds them.

ngram                 n-gram / prompt lookup (model-free)
history               candidate trees from rollout history (model-free; `drafters.history`)
history:chain         the same, one path per iteration
draft:PATH            a smaller model (HF dir or .gguf) sharing the tokenizer
self                  the policy as its own draft (an oracle: acceptance 1, for checks)
eagle3[:PATH]         an EAGLE-3 head (saved by specroll, SpecForge or for vLLM)
mtp[:PATH]            MTP heads saved by specroll
history+eagle3[:PATH] one tree per row from history and the EAGLE-3 head, each source
                      weighed by its running acceptance (`drafters.combined`); likewise
history+mtp[:PATH]    with MTP heads

On the command line a network's PATH is required. A training run names its drafter
without one (`RUN_DRAFTERS`): its network is the run's draft (`draft.init`), trained
online and published with the policy, and `assemble` builds the drafter from the run's
parts. The inverse is here too: `history_of` and `part_of` take a drafter `assemble` built
apart again, so that the shadow drafters of `pipeline.shadow_drafters` are made of the
same parts.

A loaded draft network is placed on the target's device and in its dtype: the draft runs
in the engine's dtype, and hands the verifier fp32 q either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from specroll.drafting.trainable import NETWORKS, TrainableDraft, load_draft

if TYPE_CHECKING:
    from specroll.drafters.base import Drafter
    from specroll.drafters.history import HistoryDrafter
    from specroll.model.transformer import Transformer

__all__ = [
    "NETWORKS",
    "RUN_DRAFTERS",
    "SPECS",
    "assemble",
    "build",
    "history_of",
    "network_of",
    "part_of",
    "sources",
]
RUN_DRAFTERS = ("eagle3", "mtp", "history", "history+eagle3", "history+mtp")
"""What a training run may draft with (`rollout.drafter`, `pipeline.shadow_drafters`)."""
SPECS = (
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
"""What `--drafter` accepts (module docstring)."""
EXPECTED = {
    "eagle3": "a directory with config.json and *.safetensors: an EAGLE-3 head written by "
    "`specroll draft train`, SpecForge or for vLLM",
    "mtp": "a directory with config.json and mtp.safetensors written by "
    "`specroll draft train --kind mtp`",
}
"""What a PATH of each network kind must be, for the error when it is not."""


def network_of(name: str) -> str | None:
    """The network kind a drafter name drafts with ('eagle3', 'mtp'), or None."""
    net = name.partition(":")[0].removeprefix("history+")
    return net if net in NETWORKS else None


def sources(name: str) -> set[str]:
    """{'history', 'network'}: the parts of a run's drafter `name` (what a shadow drafter
    must share with the run's own)."""
    out = {"history"} if name.startswith("history") else set()
    return out | ({"network"} if network_of(name) else set())


def is_tree(name: str) -> bool:
    """Whether drafter `name` proposes trees (its size is then a node count)."""
    return name.startswith("history") and name != "history:chain"


def assemble(
    name: str, history: HistoryDrafter | None, network: TrainableDraft | None
) -> Drafter | None:
    """The run's drafter `name` (one of `RUN_DRAFTERS`) made of these parts: a history
    store (None: a new one) and the run's draft network (None when it has none: then only
    'history' can draft)."""
    from specroll.drafters.combined import CombinedDrafter
    from specroll.drafters.history import HistoryDrafter

    if name not in RUN_DRAFTERS:
        raise ValueError(f"drafter {name!r} is not one of {', '.join(RUN_DRAFTERS)}")
    if name == "history":
        return history if history is not None else HistoryDrafter()
    if network is None:
        return None
    if network.kind != network_of(name):
        raise ValueError(f"drafter {name} needs a {network_of(name)} network, not {network.kind}")
    if name.startswith("history+"):
        return CombinedDrafter(
            history if history is not None else HistoryDrafter(), network.drafter()
        )
    return network.drafter()


def history_of(drafter: Drafter | None) -> HistoryDrafter | None:
    """The history store a drafter `assemble` built drafts from: a history drafter is its
    own, a combined drafter's is its history part; None for a drafter without one."""
    from specroll.drafters.combined import CombinedDrafter
    from specroll.drafters.history import HistoryDrafter

    if isinstance(drafter, CombinedDrafter):
        return drafter.history
    return drafter if isinstance(drafter, HistoryDrafter) else None


def part_of(drafter: Drafter | None, name: str) -> Drafter:
    """The run's drafter `name` (one of `RUN_DRAFTERS`) made of the parts of `drafter`, one
    `assemble` built: it shares `drafter`'s history store and draft network (`drafter`
    itself when it is `name`). A ValueError when `drafter` lacks a part `name` needs."""
    if drafter is not None and drafter.name == name:
        return drafter
    history = history_of(drafter)
    part = assemble(name, history, _network_of_drafter(drafter))
    if part is None or ("history" in sources(name) and history is None):
        raise ValueError(
            f"pipeline.shadow_drafters: {name} cannot be made of the run's drafter "
            f"{getattr(drafter, 'name', None)!r}"
        )
    return part


def _network_of_drafter(drafter: Drafter | None) -> TrainableDraft | None:
    """The draft network a drafter `assemble` built drafts with (a combined drafter's:
    its network part's), None for a drafter without one."""
    from specroll.drafters.combined import CombinedDrafter

    net = drafter.draft if isinstance(drafter, CombinedDrafter) else drafter
    return getattr(net, "network", None)


def build(spec: str, target: Transformer) -> Drafter:
    """The drafter `spec` names (module docstring), on top of `target`."""
    kind, _, path = spec.partition(":")
    if kind in ("history+eagle3", "history+mtp") and path:
        from specroll.drafters.combined import CombinedDrafter
        from specroll.drafters.history import HistoryDrafter

        return CombinedDrafter(HistoryDrafter(), build(spec.removeprefix("history+"), target))
    if kind == "ngram" and not path:
        from specroll.drafters.ngram import NgramDrafter

        return NgramDrafter()
    if kind == "history" and path in ("", "chain"):
        from specroll.drafters.history import HistoryDrafter

        return HistoryDrafter(chain=path == "chain")
    if kind == "self" and not path:
        from specroll.drafters.draft_model import DraftModelDrafter

        return DraftModelDrafter(target)
    if kind == "draft" and path:
        return _draft_model(path, target)
    if kind in NETWORKS and path:
        network = load_draft(_draft_dir(kind, path, spec), target)
        if network.kind != kind:
            raise ValueError(f"drafter {spec!r}: {path} holds a {network.kind} draft")
        return _placed(network, target).drafter()
    raise ValueError(f"drafter {spec!r} is not one of: {', '.join(SPECS)}")


def _draft_model(path: str, target: Transformer) -> Drafter:
    """A smaller model sharing the target's tokenizer, as a drafter."""
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
