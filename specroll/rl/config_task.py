"""The sections of a run's configuration that describe the user's task: the data it
trains and validates on, how completions are rewarded, and where the run is logged
(`rl.config` gathers every section into a TrainConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from specroll.rl.config_io import bound, check
from specroll.tasks import reward_refs
from specroll.tasks.arithmetic import LEVELS
from specroll.tasks.files import check_source
from specroll.tasks.reward import NEEDS_ANSWER

TEMPLATE_ARGS = ("conversation", "messages", "tokenize", "add_generation_prompt", "return_dict")
"""apply_chat_template arguments the trainer sets itself (not for data.chat_template_kwargs)."""


@dataclass
class DataConfig:
    """Prompts, groups and validation. Training data is the procedural math task unless
    `train` (or, as before, `task`) names a file: JSONL, Parquet, or a directory saved by
    datasets' save_to_disk."""

    task: str = "math"
    """'math' (procedural arithmetic), or a data file (the older spelling of `train`)."""
    train: str = ""
    """Training records: a JSONL/Parquet file or a save_to_disk directory ('' = `task`)."""
    val: str = ""
    """Validation records, the same forms; its first `val_size` are used. '' = the training
    file's last val_size records (held out of training), or the math task's own stream."""
    prompt_key: str = "prompt"
    """Record field holding the prompt: a string, or chat messages (kept whole)."""
    answer_key: str = "answer"
    """Record field holding the ground truth (a dotted path reaches into objects; without
    an 'answer' field, 'reward_model.ground_truth' as in DAPO-Math-17K)."""
    system_prompt: str = ""
    """A system message put before every prompt that has none of its own ('' = none)."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Extra arguments of the tokenizer's chat template, e.g. {enable_thinking: false}."""
    response_prefix: str = ""
    """Data files: text every reply starts with, written after the assistant header (not
    generated) and read by the reward with the completion, e.g. 'Answer:' (how the math
    task gets a small policy to commit to an answer); '' = none."""
    levels: tuple[int, ...] = (1, 2)
    """Difficulty levels of the math task (mixed round-robin)."""
    prompts_per_step: int = 8
    """Prompts per RL step."""
    pool: int = 0
    """Training prompts cycled in epochs: the first `pool` of the training stream (the
    math task's procedural stream, its distinct prompts apart from validation's; or the
    training file's records), each epoch in a new order; 0 = the whole stream (math:
    endless, never repeats; a file: all its training records)."""
    group_size: int = 8
    """Samples per prompt (G)."""
    val_size: int = 64
    """Held-out validation prompts (0 = no validation)."""
    val_every: int = 5
    """Validate every this many steps (and at the end)."""

    def __post_init__(self) -> None:
        self.levels = tuple(int(x) for x in self.levels)
        bad = [lv for lv in self.levels if lv not in LEVELS]
        check(
            bool(self.levels) and not bad,
            f"data.levels must be a non-empty subset of {sorted(LEVELS)}, got {list(self.levels)}",
        )
        bound("data", self, "prompts_per_step", 1)
        check(
            self.pool == 0 or self.pool >= self.prompts_per_step,
            f"data.pool must be 0 (the whole stream) or at least data.prompts_per_step="
            f"{self.prompts_per_step} (a step's prompts all differ), got {self.pool}",
        )
        check(
            self.group_size >= 2,
            f"data.group_size must be >= 2 (GRPO compares samples), got {self.group_size}",
        )
        bound("data", self, "val_size", 0)
        bound("data", self, "val_every", 1)
        if self.task != "math" and not Path(self.task).is_file():
            raise ValueError(f"data.task must be 'math' or an existing file, got {self.task!r}")
        check(
            not (self.train and self.task != "math"),
            f"data.train={self.train!r} and data.task={self.task!r} both name training "
            f"data: give it as data.train only (data.task stays 'math')",
        )
        check_source("data.train", self.train)
        check_source("data.val", self.val)
        for name in ("prompt_key", "answer_key"):
            check(bool(getattr(self, name).strip()), f"data.{name} must not be empty")
        kwargs = self.chat_template_kwargs
        check(
            isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs),
            f"data.chat_template_kwargs must be a mapping of names to values, got {kwargs!r}",
        )
        taken = sorted(set(kwargs) & set(TEMPLATE_ARGS))
        check(
            not taken,
            f"data.chat_template_kwargs may not set {', '.join(taken)} (the trainer sets "
            f"{', '.join(TEMPLATE_ARGS)})",
        )

    @property
    def train_file(self) -> str:
        """The training data file or directory ('' = the procedural math task)."""
        return self.train or ("" if self.task == "math" else self.task)


@dataclass
class RewardConfig:
    """What a completion earns: built-in or user reward functions, weighted and summed
    (README: "Train on your own data"; the signature: `tasks.rewards`)."""

    functions: tuple[str, ...] = ("math",)
    """Built-ins (math, exact_match, format) or 'path/to/file.py:fn' / 'package.module:fn'
    with fn(prompt, completion, record) -> float | dict[str, float]."""
    weights: tuple[float, ...] = ()
    """One weight per function (() = all 1)."""
    timeout_s: float = 30.0
    """Seconds a user function may take on one completion before the step fails."""

    def __post_init__(self) -> None:
        self.functions = tuple(self.functions)
        self.weights = tuple(float(w) for w in self.weights)
        reward_refs.check(self.functions)  # before any model loads; runs no user code
        check(
            not self.weights or len(self.weights) == len(self.functions),
            f"reward.weights must give one weight per reward.functions entry "
            f"({len(self.functions)}), got {len(self.weights)}",
        )
        check(
            all(math.isfinite(w) for w in self.weights),
            f"reward.weights must be finite numbers, got {list(self.weights)}",
        )
        bound("reward", self, "timeout_s", 0, above=True)

    @property
    def needs_answers(self) -> bool:
        """Whether a built-in compares with the records' answers (so each needs one)."""
        return any(f in NEEDS_ANSWER for f in self.functions)


@dataclass
class LogConfig:
    """Where metrics go."""

    tensorboard: bool = False
    """Also write TensorBoard events (needs the tensorboard package)."""
    wandb: bool = False
    """Also log to Weights & Biases (`pip install specroll[wandb]`; WANDB_MODE=offline
    writes the run under out_dir/wandb without a network)."""
    wandb_project: str = "specroll"
    """The W&B project."""
    mlflow: bool = False
    """Also log to MLflow (`pip install specroll[mlflow]`)."""
    mlflow_uri: str = ""
    """MLflow tracking URI; '' = a file store in out_dir/mlruns."""
    mlflow_experiment: str = "specroll"
    """The MLflow experiment."""
    run_name: str = ""
    """The run's name in W&B and MLflow; '' = the name of out_dir."""
    samples: int = 0
    """Completions per step written to out_dir/samples.jsonl (and the loggers): prompt,
    completion, reward, length, acceptance; the same ones for a step every time."""

    def __post_init__(self) -> None:
        bound("log", self, "samples", 0)
        check(
            not self.wandb or bool(self.wandb_project),
            "log.wandb_project must not be empty when log.wandb=true",
        )
