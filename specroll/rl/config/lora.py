"""The lora section of a run's configuration: train adapters instead of the whole policy."""

from __future__ import annotations

from dataclasses import dataclass

from specroll.model.lora import ALL, MAX_ALPHA, LoraSpec, expand_targets
from specroll.rl.config.io import bound, check, one_of

SERVES = ("merged", "adapters")
"""`lora.serve` values."""
MAX_RANK = 4096
"""Largest `lora.rank` accepted before a model is read (the model bounds it further)."""


@dataclass
class LoraConfig:
    """LoRA adapters on the policy's projections (rank 0: full fine-tuning)."""

    rank: int = 0
    """Adapter rank r; 0 trains every policy weight instead (no adapters)."""
    alpha: float = 0.0
    """Scale numerator: the adapters add alpha / r * (x A) B; 0 means 2 * rank."""
    targets: tuple[str, ...] = (ALL,)
    """Adapted projections: any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj, or 'all-linear' (each of them)."""
    dropout: float = 0.0
    """Dropout on the adapters' input in the train forward (PEFT's lora_dropout)."""
    lr: float = 5e-5
    """AdamW learning rate of the adapters (policy.lr is full fine-tuning's; the schedule
    of policy.warmup_steps / lr_schedule applies to it)."""
    serve: str = "merged"
    """How the own engine serves the adapted policy: 'merged' into its weights at each
    refit, or 'adapters' added in its forward (the learner's own operations)."""
    init: str = ""
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start
    from; its r, lora_alpha and target_modules then define the adapters ('' = fresh)."""

    def __post_init__(self) -> None:
        bound("lora", self, "rank", 0)
        check(self.rank <= MAX_RANK, f"lora.rank must be <= {MAX_RANK}, got {self.rank}")
        bound("lora", self, "alpha", 0)
        check(self.alpha <= MAX_ALPHA, f"lora.alpha must be <= {MAX_ALPHA:g}, got {self.alpha:g}")
        bound("lora", self, "lr", 0, above=True)
        check(0 <= self.dropout < 1, f"lora.dropout must be in [0, 1), got {self.dropout}")
        one_of("lora", self, "serve", SERVES)
        expand_targets(self.targets)  # a wrong name: one line naming it and the allowed ones
        if not self.on:  # a setting of adapters without adapters is a mistake, not a no-op
            default = LoraConfig.__dataclass_fields__
            changed = [
                f
                for f in ("alpha", "targets", "dropout", "lr", "serve")
                if getattr(self, f) != default[f].default
            ]
            check(
                not changed,
                f"lora.{changed[0] if changed else ''} is set but lora.rank=0 trains the whole "
                "policy without adapters: set lora.rank > 0 (or lora.init) to train adapters",
            )

    @property
    def on(self) -> bool:
        """Whether the policy trains adapters (lora.rank > 0, or an adapter to start from)."""
        return self.rank > 0 or bool(self.init)

    def spec(self) -> LoraSpec:
        """The adapters' shape from these settings (lora.init's own: `peft_io.read_spec`)."""
        return LoraSpec(
            rank=self.rank,
            alpha=self.alpha or 2.0 * self.rank,
            targets=expand_targets(self.targets),
            dropout=self.dropout,
        )
