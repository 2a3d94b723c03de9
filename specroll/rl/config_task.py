"""The sections of a run's configuration that describe the user's task: the data it
trains and validates on, how completions are rewarded, and where the run is logged
(`rl.config` gathers every section into a TrainConfig)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from specroll.rl.config_io import bound, check
from specroll.tasks import reward_refs, reward_worker
from specroll.tasks.arithmetic import LEVELS
from specroll.tasks.files import check_source
from specroll.tasks.reward import NEEDS_ANSWER

TEMPLATE_ARGS = ("conversation", "messages", "tokenize", "add_generation_prompt", "return_dict")
"""apply_chat_template arguments the trainer sets itself (not for data.chat_template_kwargs)."""
MAX_VAL_SIZE = 100_000
"""Most validation prompts (`data.val_size`): each validation generates one rollout per
prompt, and a step's seeds have room for this many (`rl.config.REQUESTS_PER_STEP`)."""
MAX_POOL = 1_000_000
"""Most training prompts in a pool of a data file (`data.pool`; 0 takes all of them)."""
MAX_MATH_POOL = 100_000
"""Most prompts in a pool of the procedural math task: the pool is searched for among
up to 16 times as many generated problems (`rl.run.task.MATH_POOL_SCAN`), and the task's
levels hold a few thousand to a few hundred thousand distinct prompts each."""
MAX_TEMPLATE_KWARGS_BYTES = 64 << 10
"""Largest `data.chat_template_kwargs` as JSON: it is copied into config.json and every
checkpoint's meta.json (template switches such as enable_thinking take a few bytes)."""


def _check_json_size(name: str, value: object, most: int) -> None:
    """ValueError naming setting `name` unless `value` is plain JSON data (strings,
    numbers, booleans, null, lists, mappings with string keys: what config.json holds)
    of at most `most` bytes."""
    try:
        size = len(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{name} must hold only strings, finite numbers, booleans, null, lists and "
            f"mappings ({e})"
        ) from None
    check(size <= most, f"{name} must be at most {most} bytes as JSON, got {size}")


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
        check(
            self.val_size <= MAX_VAL_SIZE,
            f"data.val_size must be <= {MAX_VAL_SIZE} (one validation rollout per prompt), "
            f"got {self.val_size}",
        )
        most = MAX_MATH_POOL if not self.train_file else MAX_POOL
        check(
            self.pool <= most,
            f"data.pool must be <= {most}"
            + (" for the math task" if not self.train_file else "")
            + f" (0 = the whole stream), got {self.pool}",
        )
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
        _check_json_size("data.chat_template_kwargs", kwargs, MAX_TEMPLATE_KWARGS_BYTES)

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
    with fn(prompt, completion, record) -> float | dict[str, float]. A value (and each
    component) must be finite and within +-1e6; a dict holds at most 32 components named
    like identifiers ([A-Za-z_][A-Za-z0-9_.-]*, up to 32 characters). All of them run in
    one worker process with at most 8 GiB of address space."""
    weights: tuple[float, ...] = ()
    """One weight per function (() = all 1), each within +-1e6."""
    timeout_s: float = 30.0
    """Seconds a function (built-in or yours) may take on one completion before the step
    fails (at most 3600); importing a reward module may take this, and at least 30 s."""

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
            all(math.isfinite(w) and abs(w) <= reward_refs.MAX_REWARD for w in self.weights),
            f"reward.weights must be finite numbers within +-{reward_refs.MAX_REWARD:g}, got "
            f"{list(self.weights)}",
        )
        bound("reward", self, "timeout_s", 0, above=True)
        check(
            self.timeout_s <= reward_worker.MAX_TIMEOUT_S,
            f"reward.timeout_s must be at most {reward_worker.MAX_TIMEOUT_S:g} (seconds per "
            f"completion), got {self.timeout_s}",
        )

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
