"""The Countdown reward: does the completion's expression use the record's numbers, each
exactly once, and equal its target?

    reward.functions: [examples/countdown/reward.py:countdown]

A reward function has one signature, fn(prompt, completion, record) -> float or a dict
of named floats (logged one by one and summed). `record` is the data record as loaded,
so the numbers and the target come from its own fields rather than from a single answer
string: that is why this task needs its own reward. The built-in `math` would compare
the expression's value with the answer and pay "Answer: 16" for "make 16 from 1 and 16"
just as much as "Answer: 16 / 1".

It must be a pure function of its arguments (a resumed run scores the same completions
again and must get the same rewards) and must never run the model's text: the expression
is read from its syntax tree, with integers and + - * / only, in exact fractions.
"""

from __future__ import annotations

import ast
from fractions import Fraction

from specroll.tasks import extract_answer

FORMAT_BONUS = 0.1
"""Paid for an answer line holding a readable expression, right or wrong: early in
training it is the only signal a small policy gets (TinyZero's shaping)."""
MAX_CHARS = 200
"""Longer 'expressions' are not read (a rambling answer line, not an equation)."""
_OPS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__}


def evaluate(expression: str) -> tuple[Fraction, list[int]] | None:
    """(value, the integers it uses) of an arithmetic expression, or None when it is not
    one: other syntax, names, calls, powers, unary minus, non-integers, division by 0."""
    text = expression.replace("×", "*").replace("÷", "/").split("=")[0].strip()
    if not text or len(text) > MAX_CHARS:
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    used: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return value(node.left) / value(node.right)  # ZeroDivisionError: not valid
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not allowed: {ast.dump(node)[:40]}")

    try:
        return value(tree), used
    except (ValueError, ZeroDivisionError):
        return None


def countdown(prompt: str, completion: str, record: dict) -> dict[str, float]:
    """{'format': FORMAT_BONUS if the final answer is a readable expression,
    'correct': 1.0 if it uses record['numbers'] exactly once each and equals
    record['target']} (an answer is the last `Answer:` line or `\\boxed{}`)."""
    answer = extract_answer(completion)
    got = evaluate(answer) if answer else None
    if got is None:
        return {"format": 0.0, "correct": 0.0}
    value, used = got
    right = sorted(used) == sorted(record["numbers"]) and value == record["target"]
    return {"format": FORMAT_BONUS, "correct": float(right)}
