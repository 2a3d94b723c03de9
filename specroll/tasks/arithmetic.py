"""Procedural arithmetic and word problems with exact integer answers.

Difficulty levels grow by the number of operations and the size of the numbers, so a
level can be chosen where a small policy starts between 10% and 60% accuracy (the range
where GRPO has signal: groups are neither all right nor all wrong). Generation is a pure
function of (level, seed, index): the same seed always gives the same problem set, and
train / validation splits are disjoint by construction (different seed streams).

Response format. Every reply starts with the `RESPONSE_PREFIX` "Answer:", written into the
assistant turn after the chat header (the policy continues it). This was calibrated on
the embedded SmolLM2-135M-Instruct (a Q4_1 GGUF, temperature 1.0, 96 new tokens, 96
samples per kind): asked to "end with a line 'Answer: <number>'" it reasons at random and
almost never commits to the format (0% on every level), while with the prefix it answers
level 1 at 12–33% (add 26%, sub 12%, mul 33%, word 21%) and level 2+ at about 5%. The
reward reads prefix + completion, so a completion that rambles on after the number still
counts, and one that restates the answer later is judged by its last Answer line.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

RESPONSE_PREFIX = "Answer:"
"""Start of every reply, written by the prompt (not generated); the reward reads it too."""

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas"]
ITEMS = ["apples", "books", "coins", "pencils", "stickers", "marbles", "cards", "shells"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One task instance."""

    prompt: str
    """The user message."""
    answer: str
    """Ground-truth final answer (an integer, as text)."""
    level: int
    """Difficulty level it was generated at (0 for problems loaded from a file)."""
    uid: str
    """Stable id: level-seed-index (or file:line)."""
    response_prefix: str = RESPONSE_PREFIX
    """Text the reply starts with, placed after the assistant header ("" = none)."""
    messages: tuple = field(default=(), hash=False)
    """The whole conversation when the record gave one (system and earlier turns kept for
    the chat template); () = the single user message `prompt`."""
    record: dict = field(default_factory=dict, hash=False)
    """The data record's own fields as loaded (what reward functions see); {} for
    procedural problems."""


def _level1(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(1, 9), r.randint(1, 9)
    kind = r.randrange(4)
    if kind == 0:
        return f"What is {a} + {b}?", a + b
    if kind == 1:
        return f"What is {a + b} - {b}?", a
    if kind == 2:
        return f"What is {a} times {b}?", a * b
    name, item = r.choice(NAMES), r.choice(ITEMS)
    return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have?", a + b


def _level2(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(2, 49), r.randint(2, 49)
    if r.random() < 0.5:
        return f"What is {a} + {b}?", a + b
    return f"What is {a + b} - {b}?", a


def _level3(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(11, 99), r.randint(2, 9)
    return f"What is {a} times {b}?", a * b


def _level4(r: random.Random) -> tuple[str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b, c = r.randint(5, 40), r.randint(2, 20), r.randint(1, 9)
    return (
        f"{name} has {a} {item}. {name} buys {b} more and then gives away {c}. "
        f"How many {item} does {name} have now?",
        a + b - c,
    )


def _level5(r: random.Random) -> tuple[str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    boxes, per, extra = r.randint(2, 9), r.randint(3, 12), r.randint(1, 20)
    return (
        f"{name} has {boxes} boxes with {per} {item} in each box, and {extra} loose {item}. "
        f"How many {item} does {name} have in total?",
        boxes * per + extra,
    )


LEVELS: dict[int, Callable[[random.Random], tuple[str, int]]] = {
    1: _level1,
    2: _level2,
    3: _level3,
    4: _level4,
    5: _level5,
}
"""Difficulty level → generator of (question, integer answer)."""


def generate_problems(n: int, level: int, seed: int = 0) -> list[Problem]:
    """`n` problems of one level, reproducible from `seed`."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {sorted(LEVELS)}, got {level}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    out = []
    for i in range(n):
        uid = f"{level}-{seed}-{i}"
        question, answer = LEVELS[level](random.Random(uid))
        out.append(Problem(question, str(answer), level, uid))
    return out
