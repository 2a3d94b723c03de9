"""What `specroll export` reads: a run directory or one of its checkpoints, as the policy,
its draft, its tokenizer and the run's settings.

* a checkpoint directory (`RUN/checkpoints/step-NNNNNN`): checked against its meta.json
  (a damaged one is refused, saying why), its weights read from `state.pt` or, for a
  sharded learner's checkpoint, from its DCP `learner/`, both as data only (a file that
  asks to run code is refused, naming it: `model.untrusted`, `dcp_read`); the
  architecture and tokenizer come from the run's `policy.model`, the draft's architecture
  from the checkpoint (`draft_config`);
* a run directory: its newest intact checkpoint (damaged newer ones are skipped, and
  said so), or, when it has none left, its final `policy/` and `draft/`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specroll.drafting.trainable import TrainableDraft, load_draft, new_draft
from specroll.inputs import read_json
from specroll.model import lora, peft_io
from specroll.model.transformer import Transformer
from specroll.model.untrusted import UnreadableFile, load_tensors
from specroll.model.weights import load_model, load_state, read_config
from specroll.rl.learner.fsdp import dcp_read
from specroll.rl.run import checkpoint
from specroll.rl.run.adapters import from_dict


@dataclass
class Source:
    """Where an export's weights come from."""

    path: Path
    """The checkpoint directory, or the run directory whose final policy/ is exported."""
    kind: str
    """'checkpoint' or 'final'."""
    config: dict
    """The run's settings (`TrainConfig.to_dict()`)."""
    skipped: list[str] = field(default_factory=list)
    """Damaged newer checkpoints passed over, each with the reason."""

    @property
    def rollout(self) -> dict:
        """The run's sampling settings (for generation_config.json)."""
        return {"temperature": 1.0, "max_new_tokens": 128, **self.config.get("rollout", {})}


def _run_config(run: Path) -> dict:
    return read_json(run / "config.json", "run config")


def _checkpoint(path: Path, skipped: list[str] | None = None) -> Source:
    why = checkpoint.damage(path)
    if why is not None:
        raise ValueError(f"{path} is a damaged checkpoint: {why}")
    meta = checkpoint.meta(path)
    if meta.get("format") != checkpoint.FORMAT:
        raise ValueError(
            f"{path} is in checkpoint format {meta.get('format', 1)}; this specroll reads "
            f"format {checkpoint.FORMAT}"
        )
    return Source(path, "checkpoint", meta["config"], skipped or [])


def resolve(arg: str | Path) -> Source:
    """The export source named on the command line (checked, nothing loaded yet)."""
    p = Path(arg)
    if not p.exists():
        raise ValueError(f"RUN_OR_CHECKPOINT={p} does not exist")
    if (p / "meta.json").exists() or (p / "state.pt").exists():
        return _checkpoint(p)
    if (p / "checkpoints").is_dir() or (p / "policy").is_dir():
        ck, skipped = checkpoint.newest_intact(p / "checkpoints")
        if ck is not None:
            return _checkpoint(ck, skipped)
        if (p / "policy" / "config.json").is_file():
            return Source(p, "final", _run_config(p), skipped)
        raise ValueError(
            f"{p}: no intact checkpoint under {p / 'checkpoints'} and no final policy/"
            + (": " + "; ".join(skipped) if skipped else "")
        )
    raise ValueError(
        f"RUN_OR_CHECKPOINT={p} is neither a run directory (checkpoints/, policy/) nor a "
        "checkpoint (meta.json, state.pt)"
    )


def _base_dir(src: Source) -> Path:
    """The run's policy.model as a directory: the architecture and tokenizer."""
    from specroll.model.hub import resolve as resolve_model

    model = src.config.get("policy", {}).get("model", "")
    try:
        return resolve_model(model)
    except (ValueError, OSError, RuntimeError) as e:
        raise ValueError(
            f"{src.path}: the run's policy.model={model!r} gives the architecture and the "
            f"tokenizer, and it is not usable here: {e}"
        ) from e


def _draft_spec(src: Source, state: dict) -> dict | None:
    """{kind, config} of the checkpoint's draft (older checkpoints: the run's draft/)."""
    if "draft_config" in state:
        return state["draft_config"]
    final = src.path.parent.parent / "draft" / "config.json"
    if final.is_file():
        kind = "mtp" if (final.parent / "mtp.safetensors").is_file() else "eagle3"
        return {"kind": kind, "config": read_json(final, "draft config")}
    return None


def base_name(src: Source) -> str:
    """The name of the run's base model, as a PEFT adapter records it."""
    return peft_io.base_name(_base_dir(src))


def load(
    src: Source, log=print, adapters: bool = False
) -> tuple[Transformer, TrainableDraft | None, object]:
    """(policy, draft or None, tokenizer) of the source, in fp32 on the CPU. A LoRA run's
    policy is its base with the adapters attached (`adapters`: a final policy/ too, from
    the run's adapter/ beside it; else the final policy/ is read merged, as written)."""
    from specroll.model.tokenizer import Tokenizer

    if src.kind == "final" and adapters and (src.path / "adapter" / peft_io.CONFIG).is_file():
        base = _base_dir(src)
        policy = load_model(base)
        spec = peft_io.check(src.path / "adapter", policy.cfg, "")
        lora.attach(policy, spec)
        load_state(policy, peft_io.load(src.path / "adapter", policy.cfg, spec), "adapter/", True)
        draft_dir = src.path / "draft"
        draft = load_draft(draft_dir, policy) if (draft_dir / "config.json").is_file() else None
        return policy, draft, Tokenizer(base)
    if src.kind == "final":
        policy = load_model(src.path / "policy")
        draft_dir = src.path / "draft"
        draft = load_draft(draft_dir, policy) if (draft_dir / "config.json").is_file() else None
        return policy, draft, Tokenizer(src.path / "policy")
    base = _base_dir(src)
    state = load_tensors(src.path / "state.pt", mmap=True)
    if not isinstance(state, dict):
        raise UnreadableFile(f"{src.path / 'state.pt'}: not a specroll checkpoint's state")
    if "lora_spec" in state:  # the checkpoint holds the adapters; the base is policy.model
        policy = load_model(base)
        try:
            lora.attach(policy, from_dict(state["lora_spec"]))
        except (TypeError, ValueError, KeyError) as e:
            why = f"{src.path / 'state.pt'}: its lora_spec does not fit the policy ({e})"
            raise UnreadableFile(why) from None
    else:
        policy = Transformer(read_config(base))
    spec = _draft_spec(src, state)
    try:
        draft = new_draft(spec["kind"], spec["config"], policy) if spec else None
    except (TypeError, ValueError, KeyError) as e:  # a draft_config written elsewhere
        raise UnreadableFile(
            f"{src.path / 'state.pt'}: its draft_config does not describe a draft of this "
            f"policy ({e})"
        ) from None
    if "draft" in state and draft is None:
        log(
            f"warning: {src.path} holds no draft architecture (an older specroll wrote it); "
            "exported without draft/"
        )
    if "policy" in state:
        adapted = policy.lora_spec is not None
        load_state(policy, state["policy"], f"{src.path}: the policy", partial=adapted)
        if draft is not None:
            load_state(draft, state["draft"], f"{src.path}: the draft")
    else:  # a sharded learner's checkpoint: read the weights from its DCP state
        sd = {"policy": lora.adapters(policy) if policy.lora_spec else policy.state_dict()}
        if draft is not None:
            sd["draft"] = draft.state_dict()
        dcp_read.read(sd, src.path / "learner")
    return policy, draft, Tokenizer(base)
