"""Write the Countdown task's records: reach a target from a few numbers with + - * /.

    python examples/countdown/make_data.py --out examples/countdown/countdown.jsonl

Every record is solvable by construction: the target is the value of a random expression
that uses each number once, and that expression is kept as the record's `solution` (the
reward never reads it; the tests check that it earns full reward). Intermediate values stay
positive integers, as in the game. Records are a pure function of (seed, index), and the
number of numbers cycles over --sizes, so each size is a `data_source` of its own.

A record holds what the reward needs besides the prompt: `numbers` and `target`. Its
`answer` (the target, as text) is only there for the failure messages of a run; the
reward function in reward.py does not compare with it.
"""

from __future__ import annotations

import argparse
import json
import random
from fractions import Fraction
from pathlib import Path

PROMPT = (
    "Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
    "Use each number exactly once, with + - * / and parentheses. "
    "End with a line 'Answer: <expression>'."
)
MAX_TARGET = 200
"""Targets are 1..MAX_TARGET (small models can check such sums in their head)."""


def _combine(r: random.Random, a: tuple[str, Fraction], b: tuple[str, Fraction]):
    """A random operation on two subexpressions whose result is a positive integer, or
    None when the one drawn gives none (a negative difference, an inexact quotient)."""
    (ta, va), (tb, vb) = a, b
    op = r.choice("+-*/")
    value = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va / vb}[op]
    if value <= 0 or value.denominator != 1:
        return None
    return f"({ta} {op} {tb})", value


def record(index: int, size: int, seed: int = 0) -> dict:
    """Countdown record `index` with `size` numbers (1..25), reproducible from `seed`."""
    r = random.Random(f"countdown-{seed}-{index}")
    while True:
        numbers = [r.randint(1, 25) for _ in range(size)]
        pool = [(str(n), Fraction(n)) for n in numbers]
        while len(pool) > 1:
            a, b = r.sample(range(len(pool)), 2)
            made = _combine(r, pool[a], pool[b])
            if made is None:
                break
            pool = [p for i, p in enumerate(pool) if i not in (a, b)] + [made]
        if len(pool) == 1 and 1 <= pool[0][1] <= MAX_TARGET:
            text, value = pool[0]
            target = int(value)
            solution = text[1:-1] if text.startswith("(") else text
            return {
                "prompt": PROMPT.format(numbers=numbers, target=target),
                "numbers": numbers,
                "target": target,
                "answer": str(target),
                "solution": solution,
                "data_source": f"countdown-{size}",
            }


def records(n: int, sizes: tuple[int, ...] = (2, 3, 4), seed: int = 0) -> list[dict]:
    """`n` records, record i with sizes[i % len(sizes)] numbers."""
    return [record(i, sizes[i % len(sizes)], seed) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="examples/countdown/countdown.jsonl")
    ap.add_argument("--n", type=int, default=600, help="records (the last val_size validate)")
    ap.add_argument("--sizes", default="2,3,4", help="how many numbers, cycled")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    lines = [json.dumps(rec) for rec in records(args.n, sizes, args.seed)]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} records to {args.out}")


if __name__ == "__main__":
    main()
