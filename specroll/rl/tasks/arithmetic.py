"""Procedural arithmetic and word problems with exact integer answers.

Difficulty levels grow by the number of operations and the size of the numbers, so a
level can be chosen where a small policy starts between 10% and 60% accuracy (the range
where GRPO has signal: groups are neither all right nor all wrong). Generation is a pure
function of (level, seed, index): the same seed always gives the same problem set, and
train / validation splits are disjoint by construction (different seed streams).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

INSTRUCTION = "Solve the problem. End your reply with a line 'Answer: <number>'."

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas"]
ITEMS = ["apples", "books", "coins", "pencils", "stickers", "marbles", "cards", "shells"]


@dataclass(frozen=True)
class Problem:
    """One task instance."""

    prompt: str
    """The user message (instruction included)."""
    answer: str
    """Ground-truth final answer (an integer, as text)."""
    level: int
    """Difficulty level it was generated at."""
    uid: str
    """Stable id: level-seed-index."""


def _level1(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(2, 49), r.randint(2, 49)
    return f"What is {a} + {b}?", a + b


def _level2(r: random.Random) -> tuple[str, int]:
    a, b = r.randint(11, 99), r.randint(2, 9)
    if r.random() < 0.5:
        return f"What is {a} - {b * 3}?", a - 3 * b
    return f"What is {a} times {b}?", a * b


def _level3(r: random.Random) -> tuple[str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b, c = r.randint(5, 40), r.randint(2, 20), r.randint(1, 9)
    return (
        f"{name} has {a} {item}. {name} buys {b} more and then gives away {c}. "
        f"How many {item} does {name} have now?",
        a + b - c,
    )


def _level4(r: random.Random) -> tuple[str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    boxes, per, extra = r.randint(2, 9), r.randint(3, 12), r.randint(1, 20)
    return (
        f"{name} has {boxes} boxes with {per} {item} in each box, and {extra} loose {item}. "
        f"How many {item} does {name} have in total?",
        boxes * per + extra,
    )


def _level5(r: random.Random) -> tuple[str, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    friends, per = r.randint(2, 6), r.randint(3, 15)
    total = friends * per + r.randint(0, friends - 1)
    left = total - friends * per
    return (
        f"{name} shares {total} {item} equally among {friends} friends, giving each the "
        f"largest possible equal number. How many {item} are left over?",
        left,
    )


LEVELS = {1: _level1, 2: _level2, 3: _level3, 4: _level4, 5: _level5}
"""Difficulty level → generator of (question, integer answer)."""


def generate_problems(n: int, level: int, seed: int = 0) -> list[Problem]:
    """`n` problems of one level, reproducible from `seed`."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {sorted(LEVELS)}, got {level}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    out = []
    for i in range(n):
        r = random.Random(f"{level}-{seed}-{i}")
        question, answer = LEVELS[level](r)
        out.append(Problem(f"{question} {INSTRUCTION}", str(answer), level, f"{level}-{seed}-{i}"))
    return out
