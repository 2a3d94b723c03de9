"""A run's LoRA adapters (`lora.*`): their shape, from the settings or from the user's PEFT
adapter (`lora.init`), checked against the policy before it loads, and attached to it."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from specroll.model import lora, peft_io
from specroll.model.config import ModelConfig
from specroll.model.lora import LoraSpec
from specroll.model.transformer import Transformer
from specroll.model.weights import load_state
from specroll.rl.config import TrainConfig


def spec_of(cfg: TrainConfig, model: ModelConfig, base: str = "") -> LoraSpec | None:
    """The run's adapters, checked against a policy of config `model` named `base` ('' =
    name unknown: shapes only); None for full fine-tuning. ValueError (one line, naming
    what differs) for a rank that does not fit, or an adapter of another base or targets."""
    c = cfg.lora
    if not c.on:
        return None
    if not c.init:
        spec = c.spec()
        spec.check(model)
        return spec
    spec = peft_io.check(c.init, model, base)
    mine = c.spec() if c.rank else None
    if mine is not None and mine.rank != spec.rank:
        raise ValueError(f"lora.rank={c.rank}, but lora.init={c.init} has r={spec.rank}")
    if c.targets != (lora.ALL,) and lora.expand_targets(c.targets) != spec.targets:
        raise ValueError(
            f"lora.targets={list(c.targets)}, but lora.init={c.init} adapts {list(spec.targets)}"
        )
    return spec


def check_dir(cfg: TrainConfig, model_dir: str | Path) -> None:
    """`spec_of` for the policy in `model_dir`, from its config.json (nothing loaded)."""
    from specroll.model.weights import read_config

    if cfg.lora.on:
        spec_of(cfg, read_config(model_dir), peft_io.base_name(model_dir))


def adapt(cfg: TrainConfig, policy: Transformer) -> Transformer:
    """`policy` with the run's adapters (fresh, from pipeline.seed; or lora.init's) and its
    base frozen; `policy` as it is for full fine-tuning or when it has adapters already."""
    if policy.lora_spec is not None:
        return policy
    spec = spec_of(cfg, policy.cfg)
    if spec is None:
        return policy
    lora.attach(policy, spec, seed=cfg.pipeline.seed)
    if cfg.lora.init:
        load_state(policy, peft_io.load(cfg.lora.init, policy.cfg, spec), "lora.init", True)
    return policy


def spec_dict(spec: LoraSpec) -> dict:
    """What a checkpoint keeps of the adapters' shape (`from_dict` reads it back)."""
    return {**asdict(spec), "targets": list(spec.targets)}


def from_dict(d: dict) -> LoraSpec:
    return LoraSpec(
        rank=int(d["rank"]),
        alpha=float(d["alpha"]),
        targets=lora.expand_targets(list(d["targets"])),
        dropout=float(d.get("dropout", 0.0)),
    )
