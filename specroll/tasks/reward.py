"""The built-in rewards: extract a completion's final answer and judge it.

The answer is the last `\\boxed{...}` in the completion, else the last line starting with
`Answer:` or `####` (GSM8K's marker), whichever comes later; a completion with none
earns 0 from `math` (format is part of the task). The ground truth is read the same way,
so a GSM8K answer field ("... reasoning ... #### 72") counts as "72"; a plain "72" is
taken as it is. `math` compares with math-verify (numbers, fractions, LaTeX), not as
strings; `exact_match` compares normalised text; `format` only asks that the completion
commits to an answer the extractor can read.

Every built-in has the signature of user reward functions (`specroll.tasks.rewards`):
fn(prompt, completion, record) -> float, with the ground truth in record["answer"].
"""

from __future__ import annotations

import re
from collections.abc import Callable

# "Answer: 12", "**Answer:** 12", "answer : 12" (markdown bold around the label allowed)
_ANSWER_LINE = re.compile(
    r"^\s*\**\s*answer\s*\**\s*[:：]\s*\**\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE
)
# "#### 72" (GSM8K's final-answer line)
_HASH_LINE = re.compile(r"^\s*####\s*(.+?)\s*$", re.MULTILINE)
_NUMBER = re.compile(r"-?\$?\d{1,3}(,\d{3})+(\.\d+)?")


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def _clean(answer: str) -> str:
    """'$1,000.' -> '1000': trailing full stop, dollar signs and thousands commas off."""
    answer = answer.rstrip(".").strip().strip("$").strip()
    if _NUMBER.fullmatch(answer):
        answer = answer.replace(",", "").replace("$", "")
    return answer


def extract_answer(text: str) -> str | None:
    """The final answer a completion commits to, or None."""
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    lines = [m for p in (_ANSWER_LINE, _HASH_LINE) for m in p.finditer(text)]
    if not lines:
        return None
    last = max(lines, key=lambda m: m.start())
    return _clean(last.group(1)) or None


def gold_answer(gold: str) -> str:
    """The ground truth to compare with: its marked final answer when it has one (a GSM8K
    solution ending '#### 72' gives '72'), else the text itself."""
    return extract_answer(gold) or gold.strip()


def math_reward(completion: str, gold: str) -> float:
    """1.0 if the extracted answer equals `gold` under math-verify, else 0.0."""
    from math_verify import parse, verify

    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    try:
        return float(verify(parse(f"${gold_answer(gold)}$"), parse(f"${answer}$")))
    except Exception:  # math-verify raises on unparsable input: a wrong answer, not a crash
        return 0.0


def _normal(text: str) -> str:
    """Text for exact comparison: case, surrounding space and inner runs of space folded."""
    return " ".join(_clean(text).casefold().split())


def exact_match_reward(completion: str, gold: str) -> float:
    """1.0 if the extracted answer (or, with none, the whole completion) equals `gold`
    as normalised text: for labels and short answers math-verify cannot read."""
    answer = extract_answer(completion)
    return float(
        _normal(answer if answer is not None else completion) == _normal(gold_answer(gold))
    )


def format_reward(completion: str) -> float:
    """1.0 if the completion commits to a final answer the extractor can read."""
    return float(extract_answer(completion) is not None)


BUILTINS: dict[str, Callable[[str, str, dict], float]] = {
    "math": lambda prompt, completion, record: math_reward(completion, _gold(record)),
    "exact_match": lambda prompt, completion, record: exact_match_reward(completion, _gold(record)),
    "format": lambda prompt, completion, record: format_reward(completion),
}
"""Built-in reward name -> fn(prompt, completion, record) (they run in the trainer's
process: they are ours, and fast)."""

NEEDS_ANSWER = ("math", "exact_match")
"""Built-ins that compare with the record's answer (its records must have one)."""


def _gold(record: dict) -> str:
    return str(record.get("answer") or "")
