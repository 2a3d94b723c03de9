"""The data section of a run's configuration: the prompts it trains and validates on, in groups."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from specroll.rl.config.io import bound, check
from specroll.tasks.arithmetic import LEVELS
from specroll.tasks.files import check_source

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
    `train` names a file: JSONL, Parquet, or a directory saved by datasets' save_to_disk."""

    train: str = ""
    """Training records: a JSONL/Parquet file or a save_to_disk directory ('' = the
    procedural math task)."""
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
        most = MAX_MATH_POOL if not self.train else MAX_POOL
        check(
            self.pool <= most,
            f"data.pool must be <= {most}"
            + (" for the math task" if not self.train else "")
            + f" (0 = the whole stream), got {self.pool}",
        )
        bound("data", self, "val_every", 1)
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
