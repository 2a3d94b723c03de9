"""The built-in rewards: extract a completion's final answer and judge it.

The answer is the last `\\boxed{...}` in the completion, else the last line starting with
`Answer:` or `####` (GSM8K's marker), whichever comes later; a completion with none
earns 0 from `math` (format is part of the task). The ground truth is read the same way,
so a GSM8K answer field ("... reasoning ... #### 72") counts as "72"; a plain "72" is
taken as it is. `math` compares with math-verify (numbers, fractions, LaTeX), not as
strings; `exact_match` compares normalised text; `format` only asks that the completion
commits to an answer the extractor can read.

A policy can write anything, so reading a completion takes time linear in its length:
the line patterns have no two quantifiers that can share a character (no backtracking
across lines or runs of spaces), a `\\boxed{` is scanned for at most MAX_ANSWER_CHARS,
and math-verify (whose parser is superlinear on some short inputs) is handed at most
MAX_ANSWER_CHARS under its own time bound. A final answer longer than that is no answer.

Every built-in has the signature of user reward functions (`specroll.tasks.rewards`):
fn(prompt, completion, record) -> float, with the ground truth in record["answer"].
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

MAX_ANSWER_CHARS = 512
"""The longest final answer read: a `\\boxed{}` still open after this many characters
is unreadable (as an unclosed one is), a longer `Answer:` / `####` value commits to
nothing, and `math` gives 0 rather than hand a longer text to math-verify."""
MATH_VERIFY_TIMEOUT_S = 1
"""math-verify's own bound on each parse and comparison (whole seconds: it uses
signal.alarm, 1 is the least); nested brackets or towers of powers of a few dozen
characters take it seconds."""

# "Answer: 12", "**Answer:** 12", "answer : 12" (markdown bold around the label allowed);
# the value may start on a later line ("Answer:\n72"). Whitespace before the label stays
# on its line, and each run of spaces or stars can be matched one way only.
_ANSWER_LINE = re.compile(
    r"^[^\S\n]*(?:\*+[^\S\n]*)?answer\s*(?:\*+\s*)?[:：]\s*(?:\*+\s*)?(\S(?:.*\S)?)",
    re.IGNORECASE | re.MULTILINE,
)
# "#### 72" (GSM8K's final-answer line)
_HASH_LINE = re.compile(r"^[^\S\n]*####\s*(\S(?:.*\S)?)", re.MULTILINE)
_NUMBER = re.compile(r"-?\$?\d{1,3}(,\d{3})+(\.\d+)?")
_BRACES = re.compile(r"[{}]")
_LABELS = ((_ANSWER_LINE, re.compile("answer", re.IGNORECASE)), (_HASH_LINE, re.compile("####")))
"""Each line pattern with its label: the scan starts at the line of the label's first
occurrence (a text without it costs one literal search)."""


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, with nested braces balanced (None: unclosed within
    MAX_ANSWER_CHARS)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for m in _BRACES.finditer(text, i, i + MAX_ANSWER_CHARS + 1):
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return text[i : m.start()].strip()
    return None


def _last_line(text: str) -> re.Match | None:
    """The last `Answer:` or `####` line (the later of the two patterns' last matches)."""
    last = None
    for pattern, label in _LABELS:
        first = label.search(text)
        if first is None:
            continue
        for m in pattern.finditer(text, text.rfind("\n", 0, first.start()) + 1):
            if last is None or m.start() > last.start():
                last = m
    return last


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
    last = _last_line(text)
    if last is None or len(last.group(1)) > MAX_ANSWER_CHARS:
        return None
    return _clean(last.group(1)) or None


def gold_answer(gold: str) -> str:
    """The ground truth to compare with: its marked final answer when it has one (a GSM8K
    solution ending '#### 72' gives '72'), else the text itself."""
    return extract_answer(gold) or gold.strip()


@functools.cache
def _math_verify() -> tuple[Callable, Callable]:
    """math-verify's parse and verify, warmed once under a loose bound: its first parse loads
    the LaTeX grammar and sympy's parsers, which on a cold or busy machine takes more than
    MATH_VERIFY_TIMEOUT_S and would score a right answer 0."""
    from math_verify import parse, verify

    one = parse("$1$", parsing_timeout=60)  # (0 would disable it, with a warning printed)
    verify(one, parse("$1 + 0$", parsing_timeout=60), timeout_seconds=60)
    return parse, verify


def math_reward(completion: str, gold: str) -> float:
    """1.0 if the extracted answer equals `gold` under math-verify, else 0.0 (also when
    either is longer than MAX_ANSWER_CHARS)."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    truth = gold_answer(gold)
    if len(truth) > MAX_ANSWER_CHARS:
        return 0.0
    parse, verify = _math_verify()
    try:
        t = MATH_VERIFY_TIMEOUT_S
        got = verify(
            parse(f"${truth}$", parsing_timeout=t),
            parse(f"${answer}$", parsing_timeout=t),
            timeout_seconds=t,
        )
        return float(got)
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
"""Built-in reward name -> fn(prompt, completion, record). They run in the reward worker
with the user's functions (`reward_worker`), under the same `reward.timeout_s`: a
completion is the policy's text, and math-verify's parser can take seconds on it."""

NEEDS_ANSWER = ("math", "exact_match")
"""Built-ins that compare with the record's answer (its records must have one)."""


def builtin(name: str) -> Callable[[str, str, dict], float]:
    """The built-in `name` with the libraries it calls loaded (math-verify takes ~0.4 s:
    paid when the worker loads, not by the first call under its timeout)."""
    if name == "math":
        _math_verify()

    return BUILTINS[name]


def _gold(record: dict) -> str:
    return str(record.get("answer") or "")
