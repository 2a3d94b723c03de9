"""The learner's state in `torch.distributed.checkpoint` (DCP) form: sharded checkpoints.

A DCP checkpoint is keyed by parameter name (FQN), for the model and for the optimizer
alike, and each rank writes its own shards; on load DCP reads whatever slices the loading
ranks hold, so a checkpoint saved with N ranks loads with M (one process without a
process group included: the single-process host reads one this way). The same functions serve
a sharded and a plain learner: `get_state_dict` / `set_state_dict` handle both.

A single-process checkpoint (`state.pt`: module state dicts and optimizer state dicts
keyed by parameter index) loads into a sharded learner through `load_full`: the index of
a parameter is its position in `named_parameters()`, the same in both.

A checkpoint may come from elsewhere: `load` reads it through `dcp_read`, as data only.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from specroll.model import lora
from specroll.rl.learner.fsdp import dcp_read


def _pairs(learner, draft) -> list[tuple[str, torch.nn.Module, torch.optim.Optimizer | None]]:
    """(name, module, its optimizer or None) of what a checkpoint holds."""
    out = [("policy", learner.policy, learner.opt)]
    if draft is not None:
        out.append(("draft", draft, learner.draft_opt))
    return out


def _adapted(module: torch.nn.Module) -> bool:
    """Whether `module` is a LoRA policy (its checkpoints hold only its adapters)."""
    return getattr(module, "lora_spec", None) is not None


def state_dicts(learner, draft) -> dict:
    """{policy, policy_opt, draft, draft_opt}: this rank's DCP state (optimizer states
    initialised if no step has run, so that a load has every key to fill); of a LoRA
    policy its adapters (the base is the run's policy.model)."""
    out = {}
    for name, module, opt in _pairs(learner, draft):
        if opt is None:
            out[name] = get_model_state_dict(module)
        else:
            out[name], out[name + "_opt"] = get_state_dict(module, opt)
        if _adapted(module):
            out[name] = {k: v for k, v in out[name].items() if lora.is_adapter(k)}
    return out


def save(learner, draft, path: str | Path) -> None:
    """Write this rank's part of the learner state to `path` (a collective)."""
    dcp.save(state_dicts(learner, draft), checkpoint_id=str(path))


def load(learner, draft, path: str | Path) -> None:
    """Read a DCP learner state written with any number of ranks into this learner
    (`dcp_read`: as data; a file that asks to run code is refused, naming it)."""
    sd = state_dicts(learner, draft)
    dcp_read.read(sd, path)
    for name, module, opt in _pairs(learner, draft):
        options = StateDictOptions(strict=not _adapted(module))
        if opt is None:
            set_model_state_dict(module, sd[name], options=options)
        else:
            set_state_dict(
                module,
                opt,
                model_state_dict=sd[name],
                optim_state_dict=sd[name + "_opt"],
                options=options,
            )


def load_full(learner, draft, state: dict) -> None:
    """Load a single-process `state()` (full tensors, index-keyed optimizers) into a
    (sharded) learner: every rank reads the whole state and keeps its shards."""
    for name, module, opt in _pairs(learner, draft):
        full = StateDictOptions(full_state_dict=True, strict=not _adapted(module))
        set_model_state_dict(module, state[name], options=full)
        if opt is not None:  # (the optimizer's parameters: of a LoRA policy its adapters)
            names = [n for n, p in module.named_parameters() if p.requires_grad]
            osd = by_name(state[name + "_opt"], names)
            set_optimizer_state_dict(module, opt, osd, options=full)


def by_name(opt_sd: dict, names: list[str]) -> dict:
    """An optimizer state dict keyed by parameter index -> keyed by parameter name."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in opt_sd["param_groups"]]
    return {"state": {names[i]: s for i, s in opt_sd["state"].items()}, "param_groups": groups}
