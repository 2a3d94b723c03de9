"""Named prompt sets: the procedural math mix, the generic chat set, or a data file.

Used by the RL loop (prompts with answers) and by drafter data collection (`--prompts
math|chat|FILE`), so a draft is trained on exactly the distribution the policy will be
asked to roll out. Files (read by `files.read_source`): JSONL, a JSON array, Parquet or a
`datasets.save_to_disk` directory of records, or plain text, one prompt per line. A record
holds its prompt under `Keys.prompt` (a string, or a list of chat messages kept whole:
system and earlier turns go to the chat template; roles are CHAT_ROLES, and the text of a
record is always tokenized as text, never as the template's control tokens) and its ground
truth under `Keys.answer` (a dotted path reaches into objects, as in DAPO-Math-17K's
`reward_model.ground_truth`, which is also where an 'answer'-less record is looked up).
The record's other fields stay with the problem, for reward functions and per-source
validation (`data_source`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specroll.tasks.arithmetic import Problem, generate_problems
from specroll.tasks.chat import chat_prompts
from specroll.tasks.files import json_line, json_lines, read_source
from specroll.tasks.records import FileProblems, Lines, Shapes

DEFAULT_LEVELS = (1, 2)
"""Levels of the default math mix (SmolLM2 starts at ~15%: see arithmetic.py)."""


def math_problems(n: int, seed: int = 0, levels: tuple[int, ...] = DEFAULT_LEVELS) -> list[Problem]:
    """`n` problems cycling over `levels` (problem i has level levels[i % len(levels)])."""
    if not levels:
        raise ValueError("levels must name at least one level")
    per = {lv: generate_problems(-(-n // len(levels)), lv, seed) for lv in levels}
    return [per[levels[i % len(levels)]][i // len(levels)] for i in range(n)]


@dataclass(frozen=True)
class Keys:
    """Where a record keeps its prompt and its answer (`data.prompt_key`, `data.answer_key`)."""

    prompt: str = "prompt"
    answer: str = "answer"
    """A field name or a dotted path ('reward_model.ground_truth')."""


CHAT_ROLES = ("system", "user", "assistant", "tool")
"""The roles a record's chat message may have."""
DAPO_ANSWER = "reward_model.ground_truth"
"""Where DAPO-Math-17K records keep the answer (looked up when 'answer' is absent)."""


def _record(rec: Any, where: str, keys: Keys = Keys(), prefix: str = "") -> Problem:
    """One task from a parsed line or row (its reply starting with `prefix`); a malformed
    one is a ValueError naming `where` and the field (user files are the commonest source
    of bad input)."""
    if isinstance(rec, str):
        text = _text(rec, where, "prompt")
        return Problem(text, "", 0, where, response_prefix=prefix, record={"prompt": text})
    if not isinstance(rec, dict) or keys.prompt not in rec:
        has = f"; it has {', '.join(map(repr, rec))}" if isinstance(rec, dict) else ""
        raise ValueError(f"{where}: expected a JSON object with a {keys.prompt!r} field{has}")
    rec = {k: _plain(v) for k, v in rec.items()}
    prompt, messages = rec[keys.prompt], ()
    if isinstance(prompt, list):  # chat messages: kept whole, the last user turn named
        messages = tuple(_messages(prompt, where, keys.prompt))
        prompt = _last_user_turn(messages, where, keys.prompt)
    elif not isinstance(prompt, str):
        raise ValueError(
            f"{where}: {keys.prompt!r} must be a string or a list of chat messages "
            f"({{'role': ..., 'content': ...}}), got {_kind(prompt)}"
        )
    path = keys.answer
    if keys.answer == "answer" and "answer" not in rec:
        path = DAPO_ANSWER
    value = _lookup(rec, path, where)
    answer = _answer(value, where, path)
    return Problem(
        _text(prompt, where, keys.prompt), answer, 0, where, prefix, messages=messages, record=rec
    )


def _lookup(rec: dict, path: str, where: str) -> Any:
    """rec's value at a dotted path (None where a step is missing)."""
    value: Any = rec
    parts = path.split(".")
    for i, part in enumerate(parts):
        if value is None:
            return None
        if not isinstance(value, dict):
            parent = ".".join(parts[:i])
            raise ValueError(f"{where}: {parent!r} must be an object, got {_kind(value)}")
        value = value.get(part)
    return value


def _plain(value: Any) -> Any:
    """Parquet/Arrow values as JSON-like Python (NumPy arrays and scalars unwrapped)."""
    value = _listed(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _listed(value: Any) -> Any:
    """Parquet list columns arrive as NumPy arrays: those become lists, the rest is kept."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, str) else value


def _messages(messages: list, where: str, name: str) -> list[dict]:
    """Chat messages, each {'role': str, 'content': str, ...}, the role one of CHAT_ROLES:
    templates print the role as it is, so any other text there could open a turn the
    record has no right to."""
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(
                f"{where}: {name!r} as a list must hold chat messages "
                f"({{'role': ..., 'content': ...}}), got an item that is {_kind(m)}"
            )
        if m["role"] not in CHAT_ROLES:
            shown = repr(m["role"]) if isinstance(m["role"], str) else _kind(m["role"])
            raise ValueError(
                f"{where}: a chat message's role must be one of {', '.join(CHAT_ROLES)}, "
                f"got {shown[:60]}"
            )
        if not isinstance(m.get("content"), str):
            raise ValueError(
                f"{where}: the {m['role']} message's 'content' must be a string, "
                f"got {_kind(m.get('content'))}"
            )
    return messages


def _last_user_turn(messages: tuple, where: str, name: str) -> str:
    """The content of the last user message."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise ValueError(f"{where}: {name!r} has no user message")
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


def load_file(
    path: str | Path,
    keys: Keys = Keys(),
    prefix: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> Sequence[Problem]:
    """Prompts (and answers when present) from a JSONL, Parquet, text file or a
    save_to_disk directory; `prefix` starts every reply (`data.response_prefix`),
    `progress` hears how far a JSON-lines file is read (`files.json_lines`). A JSON-lines file's
    problems are a `records.FileProblems`: checked whole now, built when used."""
    p = Path(path).expanduser()
    source = read_source(p)
    if isinstance(source, bytes):
        out = _file_problems(p, source, keys, prefix, progress)
    else:
        out = [_record(rec, where, keys, prefix) for where, rec in source]
    if not out:
        raise ValueError(f"prompt file {path} holds no prompts")
    return out


def _file_problems(p: Path, data: bytes, keys: Keys, prefix: str, progress) -> FileProblems:
    """Every line of JSON-lines `data` checked as a problem; what is kept of each is its
    line's place and its `Shapes`."""
    lines, shapes = Lines(data), Shapes()
    for i, start, end, rec in json_lines(p, data, progress):
        shapes.add(_record(rec, f"{p.name}:{i}", keys, prefix))
        lines.starts.append(start)
        lines.ends.append(end)
        lines.numbers.append(i)

    def build(text: str, i: int) -> Problem:
        return _record(json_line(p, text, i), f"{p.name}:{i}", keys, prefix)

    return FileProblems(lines, shapes, build)


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


def chat(problem: Problem, system_prompt: str = "") -> list[dict]:
    """The conversation a problem's prompt is: its messages (or its one user message),
    after a `system_prompt` unless it has a system message of its own."""
    messages = [dict(m) for m in problem.messages] or [{"role": "user", "content": problem.prompt}]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def encode(
    tok, problem: Problem, system_prompt: str = "", template_kwargs: dict | None = None
) -> list[int]:
    """Prompt ids: the conversation through the chat template (with the assistant header
    and `template_kwargs`, such as enable_thinking), then the response prefix."""
    messages = chat(problem, system_prompt)
    if len(messages) == 1 and not template_kwargs:
        ids = tok.encode_prompt(problem.prompt)
    else:
        ids = tok.encode_chat(messages, **(template_kwargs or {}))
    if problem.response_prefix:
        ids = ids + tok.encode_text(problem.response_prefix)
    return ids
