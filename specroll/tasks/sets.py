"""Named prompt sets: the procedural math mix, the generic chat set, or a file.

Used by the RL loop (prompts with answers) and by drafter data collection (`--prompts
math|chat|FILE`), so a draft is trained on exactly the distribution the policy will be
asked to roll out. Files: JSONL with either flat records {"prompt": str, "answer": str}
or DAPO-Math-17K records {"prompt": [{"role": "user", "content": str}],
"reward_model": {"ground_truth": str}}; Parquet with the same columns; or plain text, one
prompt per line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specroll.tasks.arithmetic import Problem, generate_problems
from specroll.tasks.chat import chat_prompts

DEFAULT_LEVELS = (1, 2)
"""Levels of the default math mix (SmolLM2 starts at ~15%: see arithmetic.py)."""


def math_problems(n: int, seed: int = 0, levels: tuple[int, ...] = DEFAULT_LEVELS) -> list[Problem]:
    """`n` problems cycling over `levels` (problem i has level levels[i % len(levels)])."""
    if not levels:
        raise ValueError("levels must name at least one level")
    per = {lv: generate_problems(-(-n // len(levels)), lv, seed) for lv in levels}
    return [per[levels[i % len(levels)]][i // len(levels)] for i in range(n)]


def _record(rec: Any, where: str) -> Problem:
    """One task from a parsed line or Parquet row; a malformed one is a ValueError naming
    `where` and the field (user files are the commonest source of bad input)."""
    if isinstance(rec, str):
        return Problem(_text(rec, where, "prompt"), "", 0, where, response_prefix="")
    if not isinstance(rec, dict) or "prompt" not in rec:
        raise ValueError(f"{where}: expected a JSON object with a 'prompt' field")
    prompt = _listed(rec["prompt"])
    if isinstance(prompt, list):  # DAPO / chat-message form: the last user turn
        prompt = _last_user_turn(prompt, where)
    elif not isinstance(prompt, str):
        raise ValueError(
            f"{where}: 'prompt' must be a string or a list of chat messages "
            f"({{'role': ..., 'content': ...}}), got {_kind(prompt)}"
        )
    if "answer" in rec:
        answer = _answer(rec["answer"], where, "answer")
    else:
        reward_model = rec.get("reward_model")
        if reward_model is None:
            reward_model = {}
        if not isinstance(reward_model, dict):
            raise ValueError(
                f"{where}: 'reward_model' must be an object, got {_kind(reward_model)}"
            )
        answer = _answer(reward_model.get("ground_truth"), where, "reward_model.ground_truth")
    return Problem(_text(prompt, where, "prompt"), answer, 0, where, response_prefix="")


def _listed(value: Any) -> Any:
    """Parquet list columns arrive as NumPy arrays: those become lists, the rest is kept."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, str) else value


def _last_user_turn(messages: list, where: str) -> str:
    """The content of the last {'role': 'user', 'content': str} message."""
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(
                f"{where}: 'prompt' as a list must hold chat messages "
                f"({{'role': ..., 'content': ...}}), got an item that is {_kind(m)}"
            )
    users = [m.get("content") for m in messages if m["role"] == "user"]
    if not users:
        raise ValueError(f"{where}: 'prompt' has no user message")
    if not isinstance(users[-1], str):
        raise ValueError(
            f"{where}: the user message's 'content' must be a string, got {_kind(users[-1])}"
        )
    return users[-1]


def _text(value: str, where: str, name: str) -> str:
    if not value.strip():
        raise ValueError(f"{where}: {name!r} is empty")
    return value


def _answer(value: Any, where: str, name: str) -> str:
    """An answer as text: strings as they are, numbers printed, missing (None/NaN) empty."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    value = value.item() if hasattr(value, "item") and not isinstance(value, str) else value
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        leaf = name.rpartition(".")[2]
        raise ValueError(f"{where}: {leaf!r} must be a string or a number, got {_kind(value)}")
    return str(value)


def _kind(value: Any) -> str:
    """'a list', 'an object', 'null' ... in JSON's words (what the user wrote)."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"a number ({value})"
    return names.get(type(value), f"a {type(value).__name__}")


def load_file(path: str | Path) -> list[Problem]:
    """Prompts (and answers when present) from a JSONL, Parquet or text file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompt file {p} does not exist")
    if p.suffix == ".parquet":
        try:
            import pandas as pd
        except ImportError as e:
            raise ValueError("reading Parquet needs pandas and pyarrow installed") from e
        return [
            _record(r, f"{p.name}:{i}") for i, r in enumerate(pd.read_parquet(p).to_dict("records"))
        ]
    out = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix in (".jsonl", ".json"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{i}: not valid JSON ({e.msg})") from e
        else:
            rec = line.strip()
        out.append(_record(rec, f"{p.name}:{i}"))
    if not out:
        raise ValueError(f"prompt file {p} holds no prompts")
    return out


def prompt_set(spec: str, n: int, seed: int = 0) -> list[Problem]:
    """`n` prompts of set `spec`: 'math', 'chat' or a file path (cycled if shorter)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if spec == "math":
        return math_problems(n, seed)
    if spec == "chat":
        return [
            Problem(t, "", 0, f"chat-{seed}-{i}", "") for i, t in enumerate(chat_prompts(n, seed))
        ]
    if "/" not in spec and "." not in spec:
        raise ValueError(f"prompts must be 'math', 'chat' or a file path, got {spec!r}")
    items = load_file(spec)
    return [items[i % len(items)] for i in range(n)]


def encode(tok, problem: Problem) -> list[int]:
    """Prompt ids: chat template with the assistant header, then the response prefix."""
    ids = tok.encode_prompt(problem.prompt)
    if problem.response_prefix:
        ids = ids + tok.hf.encode(problem.response_prefix, add_special_tokens=False)
    return ids
