"""Configuration of `specroll train`: one small dataclass per subsystem.

A preset is a YAML file (`specroll/rl/presets/<name>.yaml`) mapping section → field →
value; `--set section.field=value` overrides on the command line (values parsed as YAML).
Unknown sections or fields and values of the wrong type or range are rejected with a
message that names them and lists what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specroll.drafting.registry import network_of, sources
from specroll.rl.config.data import DataConfig
from specroll.rl.config.draft import DraftConfig
from specroll.rl.config.io import (
    apply_overrides,
    build_sections,
    check,
    check_names,
    layer,
    read_yaml,
)
from specroll.rl.config.learner import LearnerConfig
from specroll.rl.config.log import LogConfig
from specroll.rl.config.lora import LoraConfig
from specroll.rl.config.loss import MAX_REFILL_ROUNDS, LossConfig
from specroll.rl.config.pipeline import (
    MAX_LAG,
    MAX_STEPS,
    REQUESTS_PER_STEP,
    STEP_STRIDE,
    PipelineConfig,
    max_seed,
)
from specroll.rl.config.policy import PolicyConfig
from specroll.rl.config.ray import RayConfig
from specroll.rl.config.reward import RewardConfig
from specroll.rl.config.rollout import RolloutConfig

__all__ = [
    "MAX_LAG",
    "MAX_REFILL_ROUNDS",
    "MAX_STEPS",
    "REQUESTS_PER_STEP",
    "SECTIONS",
    "STEP_STRIDE",
    "DataConfig",
    "DraftConfig",
    "LearnerConfig",
    "LogConfig",
    "LoraConfig",
    "LossConfig",
    "PipelineConfig",
    "PolicyConfig",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainConfig",
    "build_config",
    "from_dict",
    "load_preset",
    "max_seed",
]

PRESETS = Path(__file__).parent.parent / "presets"
"""The presets shipped with specroll (`--preset NAME`)."""


@dataclass
class TrainConfig:
    """Everything `specroll train` runs with."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    log: LogConfig = field(default_factory=LogConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        d = self.rollout.drafter
        for name in self.pipeline.shadow_drafters:
            check(
                sources(name) <= sources(d) and network_of(name) in (None, network_of(d)),
                f"pipeline.shadow_drafters: {name} is not made of the parts of the run's "
                f"rollout.drafter={d} (its history, its network); with "
                f"rollout.drafter=history+eagle3 any of history, eagle3 can be compared",
            )
        if self.pipeline.shadow_drafters:
            check(
                self.pipeline.shadow_every > 0 and self.rollout.backend == "local",
                "pipeline.shadow_drafters needs pipeline.shadow_every > 0 and "
                f"rollout.backend=local (got shadow_every={self.pipeline.shadow_every}, "
                f"backend={self.rollout.backend})",
            )
        rows = self.data.prompts_per_step * self.data.group_size
        check(
            self.loss.updates_per_step <= rows,
            f"loss.updates_per_step={self.loss.updates_per_step} must be at most a step's "
            f"rollouts, data.prompts_per_step x data.group_size = {rows} (each update "
            "trains on its own part of them)",
        )
        # refill rounds are generated after the step's rewards are known, with the weights
        # of the step: the window of asynchronous steps submits before that
        check(
            self.loss.max_refill_rounds == 0 or self.pipeline.max_lag == 0,
            f"loss.max_refill_rounds={self.loss.max_refill_rounds} needs pipeline.max_lag=0 "
            f"(refill generates after the step's rewards; async runs submit ahead), got "
            f"max_lag={self.pipeline.max_lag}",
        )

    def policy_lr(self) -> float:
        """The learning rate of what trains in the policy: lora.lr with adapters, else
        policy.lr."""
        return self.lora.lr if self.lora.on else self.policy.lr

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def learner_placement(self) -> str:
        """'local' or 'ray': `learner.placement`, with 'auto' resolved."""
        placement = self.learner.placement
        if placement == "auto":
            return "ray" if self.rollout.backend == "ray" else "local"
        return placement


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}
"""Section name -> its dataclass (the fields of TrainConfig)."""


def from_dict(raw: dict[str, Any]) -> TrainConfig:
    """Build a TrainConfig from {section: {field: value}}; unknown names are errors."""
    return TrainConfig(**build_sections(_retired(raw), SECTIONS))


RETIRED = {
    "rollout.nodes": "rollout.k (a tree drafter's node count)",
    "draft.kind": "rollout.drafter (eagle3, mtp, history+eagle3 or history+mtp name the network)",
    "data.task": "data.train ('' = the procedural math task)",
    "loss.token_level": "loss.aggregation (token_mean or seq_mean_token_mean)",
}
"""Fields that are no more -> what replaced them."""
RETIRED_DRAFTERS = {"draft": "eagle3 or mtp", "history+draft": "history+eagle3 or history+mtp"}
"""`rollout.drafter` values that are no more -> what replaced them."""


def _retired(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw`, unless it sets a retired field or drafter: then a one-line error naming the
    replacement."""
    for key, new in RETIRED.items():
        section, name = key.split(".")
        if isinstance(raw.get(section), dict) and name in raw[section]:
            raise ValueError(f"{key} is retired: set {new}")
    for key in ("rollout.drafter", "pipeline.shadow_drafters"):
        section, name = key.split(".")
        value = raw.get(section, {}).get(name) if isinstance(raw.get(section), dict) else None
        for v in value if isinstance(value, list | tuple) else [value]:
            if isinstance(v, str) and v in RETIRED_DRAFTERS:
                raise ValueError(f"{key}={v} is retired: name the network, {RETIRED_DRAFTERS[v]}")
    return raw


def load_preset(name: str) -> dict[str, Any]:
    """Raw mapping of a preset name or a YAML file path."""
    path = Path(name)
    if not path.suffix:
        path = PRESETS / f"{name}.yaml"
        if not path.is_file():
            names = sorted(p.stem for p in PRESETS.glob("*.yaml"))
            raise ValueError(f"unknown preset {name!r}; presets: {', '.join(names)}")
    elif not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    return read_yaml(path)


def build_config(
    preset: str = "default", overrides: list[str] | None = None, configs: tuple[str, ...] = ()
) -> TrainConfig:
    """Preset (name or YAML path), then each `--config` file layered over it (a field a
    file does not set keeps the preset's value), then the overrides → TrainConfig."""
    raw = load_preset(preset)
    for name in configs:
        path = Path(name)
        if not path.is_file():
            what = "a directory" if path.is_dir() else "not a file"
            raise ValueError(f"--config {name}: {what if path.exists() else 'does not exist'}")
        top = read_yaml(path)
        check_names(top, SECTIONS, f"--config {name}")
        raw = layer(raw, top)
    return from_dict(apply_overrides(raw, overrides or []))
