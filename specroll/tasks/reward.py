"""Reward for verifiable math answers: extract the final answer, check it with math-verify.

The answer is the last `\\boxed{...}` in the completion, else the last line starting
with `Answer:`; a completion with neither earns 0 (format is part of the task). The
comparison is math-verify's (numbers, fractions, LaTeX expressions), not string equality.
"""

from __future__ import annotations

import re

# "Answer: 12", "**Answer:** 12", "answer : 12" (markdown bold around the label allowed)
_ANSWER_LINE = re.compile(
    r"^\s*\**\s*answer\s*\**\s*[:：]\s*\**\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE
)


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


def extract_answer(text: str) -> str | None:
    """The final answer a completion commits to, or None."""
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    lines = _ANSWER_LINE.findall(text)
    if not lines:
        return None
    return lines[-1].rstrip(".").strip().strip("$").strip() or None


def math_reward(completion: str, gold: str) -> float:
    """1.0 if the extracted answer equals `gold` under math-verify, else 0.0."""
    from math_verify import parse, verify

    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    try:
        return float(verify(parse(f"${gold}$"), parse(f"${answer}$")))
    except Exception:  # math-verify raises on unparsable input: a wrong answer, not a crash
        return 0.0
