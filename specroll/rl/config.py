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

from specroll.device import check_device_name, check_dtype_name
from specroll.drafters.trainable import KINDS
from specroll.rl.config_io import (
    apply_overrides,
    bound,
    build_sections,
    check,
    check_names,
    layer,
    one_of,
    read_yaml,
)
from specroll.rl.config_rollout import DRAFTERS, RolloutConfig, drafter_sources
from specroll.rl.config_task import DataConfig, LogConfig, RewardConfig

PRESETS = Path(__file__).parent / "presets"
WORKER_BACKENDS = ("local", "vllm")
"""In-process backends a Ray rollout worker can run (`ray.worker_backend`)."""
LR_SCHEDULES = ("constant", "linear", "cosine")
"""`policy.lr_schedule` values."""
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
"""`loss.aggregation` values (`rl.algo.loss.micro_share`)."""
KL_ESTIMATORS = ("k1", "k2", "k3")
"""`loss.kl_estimator` values (`rl.algo.loss.kl_estimate`)."""
EXPORT_DTYPES = ("float32", "bfloat16")
"""`pipeline.export_dtype` values (and `specroll export --dtype`)."""


@dataclass
class PolicyConfig:
    """The policy and its optimizer."""

    model: str = "smollm2"
    """Policy: 'smollm2' (embedded default), 'tiny' (random tiny model), HF dir or .gguf."""
    lr: float = 5e-6
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip of the policy update."""
    micro_batch: int = 16
    """Sequences per learner forward (gradients accumulate over micro-batches)."""
    warmup_steps: int = 0
    """Linear learning-rate warmup over the first this-many RL steps (0 = none)."""
    lr_schedule: str = "constant"
    """After warmup: 'constant', or 'linear' / 'cosine' decay towards min_lr_ratio * lr
    over the remaining pipeline.steps (a pure function of the step: `learner.schedule`)."""
    min_lr_ratio: float = 0.0
    """lr_schedule 'linear' / 'cosine': the floor of the decay, as a fraction of lr."""

    def __post_init__(self) -> None:
        bound("policy", self, "lr", 0, above=True)
        bound("policy", self, "grad_clip", 0, above=True)
        bound("policy", self, "micro_batch", 1)
        bound("policy", self, "warmup_steps", 0)
        one_of("policy", self, "lr_schedule", LR_SCHEDULES)
        check(
            0 <= self.min_lr_ratio <= 1,
            f"policy.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}",
        )
        check(
            self.min_lr_ratio == 0 or self.lr_schedule != "constant",
            f"policy.min_lr_ratio={self.min_lr_ratio} needs policy.lr_schedule 'linear' or "
            "'cosine' (a constant schedule does not decay)",
        )


RECOMPUTE = ("auto", "always")
"""`learner.recompute_logprobs` values."""
STRATEGIES = ("single", "fsdp")
"""`learner.strategy` values."""
PLACEMENTS = ("auto", "local", "ray")
"""`learner.placement` values."""


@dataclass
class LearnerConfig:
    """Where and how the learner computes (the optimizer itself: section `policy`)."""

    device: str = "auto"
    """Where the learner trains: 'auto' (CUDA when present, else CPU), 'cpu', 'cuda[:N]'."""
    dtype: str = "float32"
    """Compute dtype: 'float32', or 'bfloat16' (autocast over fp32 master weights and
    fp32 optimizer state; log-softmax and the loss in fp32)."""
    recompute_logprobs: str = "auto"
    """Stage `logprob`: 'always' recomputes the old log-probs with the learner; 'auto'
    uses the engine's (equal to float rounding when both sides are fp32 and the samples
    are on-policy), checking them against a recomputation on the first step and every
    `check_every` steps, and recomputing from then on if a check fails."""
    check_every: int = 10
    """recompute_logprobs='auto': steps between agreement checks (the first step is one)."""
    strategy: str = "single"
    """'single' (one process) or 'fsdp' (`ranks` processes, FSDP2-sharded policy)."""
    ranks: int = 1
    """Learner ranks (data-parallel, one process group); more than 1 needs strategy 'fsdp'."""
    placement: str = "auto"
    """Where the learner runs: 'local' (this process, or local processes for FSDP ranks),
    'ray' (Ray actors: weights then go from the learner to Ray rollout workers without
    passing through this process), or 'auto' (ray when rollout.backend is ray)."""

    def __post_init__(self) -> None:
        one_of("learner", self, "strategy", STRATEGIES)
        check(
            isinstance(self.ranks, int) and self.ranks >= 1,
            f"learner.ranks must be an integer >= 1, got {self.ranks!r}",
        )
        check(
            self.ranks <= 1024,
            f"learner.ranks must be <= 1024 (each rank is a process with its own "
            f"activations), got {self.ranks}",
        )
        check(
            self.ranks == 1 or self.strategy == "fsdp",
            f"learner.ranks={self.ranks} needs learner.strategy=fsdp (single is one process)",
        )
        one_of("learner", self, "placement", PLACEMENTS)
        check_device_name("learner.device", self.device)
        check_dtype_name("learner.dtype", self.dtype)
        one_of("learner", self, "recompute_logprobs", RECOMPUTE)
        bound("learner", self, "check_every", 1)


@dataclass
class DraftConfig:
    """The draft (EAGLE-3 or MTP) and its online training."""

    kind: str = "eagle3"
    """Architecture of a new draft ('eagle3' or 'mtp'); a draft directory says its own."""
    init: str = "default"
    """'default' (in-domain draft built once and cached), 'random', or a draft directory."""
    online: bool = True
    """Train the draft every step on the policy forward's detached features."""
    weight: float = 1.0
    """lambda: weight of the draft loss (it has its own optimizer; see learner)."""
    lr: float = 3e-4
    """Draft AdamW learning rate."""
    grad_clip: float = 1.0
    """Gradient-norm clip of the draft update (separate from the policy's)."""
    ttt_steps: int = 3
    """Training-time-test unroll of the online draft loss."""
    step_decay: float = 0.8
    """Weight of unroll step j in the online draft loss is step_decay**j."""
    draft_vocab_size: int = 8192
    """Draft vocabulary when init='random'."""

    def __post_init__(self) -> None:
        bound("draft", self, "weight", 0)
        bound("draft", self, "lr", 0, above=True)
        bound("draft", self, "ttt_steps", 1)
        check(
            0 < self.step_decay <= 1, f"draft.step_decay must be in (0, 1], got {self.step_decay}"
        )
        one_of("draft", self, "kind", KINDS)


MAX_REFILL_ROUNDS = 64
"""Most extra generation rounds per step (`loss.max_refill_rounds`)."""


@dataclass
class LossConfig:
    """GRPO / DAPO objective (see rl.algo.loss)."""

    clip_low: float = 0.2
    """Lower clip range: ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """Upper clip range (DAPO clip-higher): ratio <= 1 + clip_high."""
    aggregation: str = "token_mean"
    """How token losses make the loss: 'token_mean' (DAPO: every token of the update
    weighs the same), 'seq_mean_token_mean' (GRPO: mean per sequence, then over
    sequences) or 'seq_mean_token_sum_norm' (Dr. GRPO: sum per sequence divided by the
    constant rollout.max_new_tokens, then mean over sequences). Replaces token_level."""
    drop_uniform_groups: bool = True
    """Drop groups whose rewards are all equal (DAPO dynamic sampling)."""
    max_refill_rounds: int = 0
    """Dynamic sampling with refill (needs drop_uniform_groups): up to this many extra
    rounds of prompts_per_step fresh prompts per step, until prompts_per_step informative
    groups are kept (the first ones, in draw order); 0 = drop without refill."""
    mask_truncated: bool = False
    """Overlong filtering: responses cut by the budget (max_new_tokens or the context
    window) contribute no loss (they still count in their group's advantages)."""
    overlong_buffer: int = 0
    """Soft overlong penalty over the last this-many tokens of the budget (0 = off)."""
    kl_coef: float = 0.0
    """KL penalty to the initial policy (estimator: kl_estimator); 0 = off (no reference
    copy)."""
    kl_estimator: str = "k3"
    """Per-token estimate of KL(pi || ref) from log r = log ref - log pi: 'k1' (-log r),
    'k2' ((log r)^2 / 2) or 'k3' (r - 1 - log r; Schulman 2020)."""
    scale_advantages: bool = True
    """Divide advantages by the group std (GRPO); False = mean-centred only."""
    updates_per_step: int = 1
    """Optimizer steps per RL step (the batch is split; >1 makes the clip matter)."""
    behaviour_weight_cap: float = 2.0
    """Async (pipeline.max_lag > 0): cap of the decoupled-PPO importance weight
    pi_prox / pi_behaviour that corrects for samples drawn by an older policy."""
    tis_cap: float = 0.0
    """Truncated importance sampling of the rollout-learner mismatch: weight each token's
    loss by min(pi_learner / pi_engine, tis_cap) (bf16 or GPU engines sample from a
    slightly different distribution than the learner scores); 0 = off."""

    def __post_init__(self) -> None:
        check(0 <= self.clip_low < 1, f"loss.clip_low must be in [0, 1), got {self.clip_low}")
        bound("loss", self, "clip_high", 0)
        bound("loss", self, "overlong_buffer", 0)
        bound("loss", self, "kl_coef", 0)
        bound("loss", self, "updates_per_step", 1)
        check(
            self.tis_cap == 0 or self.tis_cap >= 1,
            f"loss.tis_cap must be 0 (off) or >= 1, got {self.tis_cap}",
        )
        one_of("loss", self, "aggregation", AGGREGATIONS)
        one_of("loss", self, "kl_estimator", KL_ESTIMATORS)
        bound("loss", self, "max_refill_rounds", 0)
        check(
            self.max_refill_rounds <= MAX_REFILL_ROUNDS,
            f"loss.max_refill_rounds must be <= {MAX_REFILL_ROUNDS}, got {self.max_refill_rounds}",
        )
        check(
            self.max_refill_rounds == 0 or self.drop_uniform_groups,
            f"loss.max_refill_rounds={self.max_refill_rounds} refills dropped groups: it "
            "needs loss.drop_uniform_groups=true",
        )


STEP_STRIDE = 1_000_003
"""step_seed(base, s) = base * STEP_STRIDE + s (`rl.run.task.step_seed`): distinct (base,
step) pairs never meet."""
REQUESTS_PER_STEP = 100_000
"""Request seeds of step s start at step_seed * this (room for that many rollouts)."""
MAX_STEPS = 1_000_000
"""Most RL steps (`pipeline.steps`): step s of a run draws from seed base * STEP_STRIDE +
s (`rl.run.task.step_seed`), distinct from every other run's steps only while s stays
below STEP_STRIDE."""
MAX_LAG = 64
"""Most steps generated ahead (`pipeline.max_lag`): each one's rollouts wait in memory."""


def max_seed() -> int:
    """The largest `pipeline.seed`: the rollouts of every step derive their seeds from it
    (`rl.run.task`: (seed * STEP_STRIDE + step) * REQUESTS_PER_STEP + i), and each must
    stay below the engine's SEED_LIMIT (2**62, `spec.rng`)."""
    from specroll.spec.rng import SEED_LIMIT

    return SEED_LIMIT // (STEP_STRIDE * REQUESTS_PER_STEP) - 1


@dataclass
class PipelineConfig:
    """The run: length, seed, checkpoints."""

    steps: int = 10
    """RL steps."""
    seed: int = 0
    """Seeds data order, rollouts, and initialisation."""
    out_dir: str = "runs/default"
    """Metrics, checkpoints and the final policy/draft go here."""
    checkpoint_every: int = 5
    """Steps between checkpoints (0 = only at the end and on Ctrl-C)."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept."""
    shadow_every: int = 0
    """Every this many steps, also generate the step's requests without speculation (same
    prompts, seeds and policy version; discarded) to measure the generation speed-up
    (0 = never)."""
    shadow_drafters: tuple[str, ...] = ()
    """At shadow steps, also generate the step's requests with each of these drafters
    (rollout.drafter values made of the run's own drafter's sources, e.g. eagle3 and
    history beside history+eagle3) on the same weights, seeds and history (discarded):
    each one's acceptance and speed-up over plain decoding, measured in one run
    (metrics `shadow/<drafter>/...`; local backend)."""
    max_lag: int = 0
    """Asynchronous RL: rollouts for steps t+1..t+max_lag are generated while the learner
    trains step t (samples up to max_lag updates old; older ones are dropped and counted).
    0 = synchronous. Overlap needs the Ray backend."""
    export_every: int = 0
    """Every this many steps, write a loadable HF export of the policy (and its draft/)
    to out_dir/exports/step-NNNNNN; all are kept (0 = only the final policy/)."""
    export_dtype: str = "float32"
    """Weights of the exports and the final policy/: 'float32' or 'bfloat16'."""

    def __post_init__(self) -> None:
        bound("pipeline", self, "steps", 1)
        check(
            self.steps <= MAX_STEPS,
            f"pipeline.steps must be <= {MAX_STEPS} (each step's seeds must differ from "
            f"every other's), got {self.steps}",
        )
        top = max_seed()
        check(
            0 <= self.seed <= top,
            f"pipeline.seed must be in [0, {top}] (every rollout's seed derives from it and "
            f"must stay below 2**62), got {self.seed}",
        )
        bound("pipeline", self, "max_lag", 0)
        check(
            self.max_lag <= MAX_LAG,
            f"pipeline.max_lag must be <= {MAX_LAG} (each step generated ahead waits in "
            f"memory), got {self.max_lag}",
        )
        bound("pipeline", self, "export_every", 0)
        one_of("pipeline", self, "export_dtype", EXPORT_DTYPES)
        bound("pipeline", self, "checkpoint_every", 0)
        bound("pipeline", self, "keep_checkpoints", 1)
        self.shadow_drafters = tuple(self.shadow_drafters)
        for name in self.shadow_drafters:
            check(
                name in DRAFTERS,
                f"pipeline.shadow_drafters: {name!r} is not one of {', '.join(DRAFTERS)}",
            )


MAX_RAY_WORKERS = 1024
"""Most Ray rollout workers (`ray.workers`), as many as learner ranks may be."""


@dataclass
class RayConfig:
    """Ray placement: rollout workers (`rollout.backend: ray`), each an engine replica
    (policy + draft), and the learner's actors (`learner.placement: ray`)."""

    worker_backend: str = "local"
    """The engine inside each worker: 'local' (specroll's engine) or 'vllm' (one vLLM engine
    per worker, started on the first weights it is sent; `pip install -e .[vllm]`)."""
    address: str = ""
    """'' = start a local Ray; otherwise a cluster address to join ('auto', 'ray://...')."""
    workers: int = 2
    """Rollout workers (engine replicas); each takes a share of every step's prompts."""
    cpus_per_worker: float = 1.0
    """CPUs each worker reserves (and its torch threads)."""
    gpus_per_worker: float = 0.0
    """GPUs each worker reserves (0 on CPU machines)."""
    max_restarts: int = 3
    """Times a step may restart dead workers (re-queueing their prompts) before failing."""
    learner_cpus: float = 0.0
    """CPUs each learner actor (rank) reserves (0 = none: it shares the node, as a driver
    would)."""
    learner_gpus: float = 0.0
    """GPUs each learner actor (rank) reserves."""

    def __post_init__(self) -> None:
        one_of("ray", self, "worker_backend", WORKER_BACKENDS)
        bound("ray", self, "workers", 1)
        check(
            self.workers <= MAX_RAY_WORKERS,
            f"ray.workers must be <= {MAX_RAY_WORKERS} (each is a process with its own "
            f"copy of the policy), got {self.workers}",
        )
        bound("ray", self, "cpus_per_worker", 0, above=True)
        bound("ray", self, "gpus_per_worker", 0)
        bound("ray", self, "max_restarts", 0)
        bound("ray", self, "learner_cpus", 0)
        bound("ray", self, "learner_gpus", 0)


@dataclass
class TrainConfig:
    """Everything `specroll train` runs with."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
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
                drafter_sources(name) <= drafter_sources(d),
                f"pipeline.shadow_drafters: {name} drafts from sources the run's "
                f"rollout.drafter={d} does not keep (its history, its network); with "
                f"rollout.drafter=history+draft any of history, draft can be compared",
            )
            check(  # the network it would run is the run's, of draft.kind
                name.removeprefix("history+") in ("history", "draft", self.draft.kind),
                f"pipeline.shadow_drafters: {name} names a network of another kind than "
                f"draft.kind={self.draft.kind}",
            )
        if self.pipeline.shadow_drafters:
            check(
                self.pipeline.shadow_every > 0 and self.rollout.backend == "local",
                "pipeline.shadow_drafters needs pipeline.shadow_every > 0 and "
                f"rollout.backend=local (got shadow_every={self.pipeline.shadow_every}, "
                f"backend={self.rollout.backend})",
            )
        net = d.removeprefix("history+")
        check(
            net in ("history", "draft", self.draft.kind),
            f"rollout.drafter={d} uses a {net} network but draft.kind={self.draft.kind}: set "
            f"rollout.drafter to draft, history+draft or history, or draft.kind={net}",
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
    return TrainConfig(**build_sections(_renamed(raw), SECTIONS))


def _renamed(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with retired fields spelled as their replacements, so that older presets and
    `--set` lines keep working: loss.token_level true / false is loss.aggregation
    'token_mean' / 'seq_mean_token_mean' (both given and disagreeing is an error)."""
    loss = raw.get("loss")
    if not isinstance(loss, dict) or "token_level" not in loss:
        return raw
    loss = dict(loss)
    old = loss.pop("token_level")
    if not isinstance(old, bool):
        raise ValueError(f"loss.token_level must be true or false, got {old!r}")
    want = "token_mean" if old else "seq_mean_token_mean"
    if loss.setdefault("aggregation", want) != want:
        raise ValueError(
            f"loss.token_level={str(old).lower()} (retired: it means loss.aggregation={want}) "
            f"contradicts loss.aggregation={loss['aggregation']}; set only loss.aggregation"
        )
    return {**raw, "loss": loss}


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
