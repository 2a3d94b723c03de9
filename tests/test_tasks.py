"""Arithmetic tasks and the math reward: what the RL loop will train on."""

from __future__ import annotations

import pytest

from specroll.rl.tasks import LEVELS, extract_answer, generate_problems, math_reward


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_problems_are_reproducible_and_correct(level):
    a = generate_problems(50, level, seed=3)
    assert a == generate_problems(50, level, seed=3)
    assert a != generate_problems(50, level, seed=4)
    assert len({p.uid for p in a}) == 50
    for p in a:
        assert p.prompt.endswith("?") and p.response_prefix == "Answer:"
        assert str(int(p.answer)) == p.answer
        assert p.level == level


def test_level_checks():
    with pytest.raises(ValueError, match="level"):
        generate_problems(3, 9)
    with pytest.raises(ValueError, match="n must be"):
        generate_problems(-1, 1)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so 7*8 = 56.\nAnswer: 56", "56"),
        ("Answer: 12\nwait, no.\nAnswer: 13.", "13"),
        ("the result is \\boxed{\\frac{1}{2}} indeed", "\\frac{1}{2}"),
        ("\\boxed{3} then \\boxed{4}", "4"),
        ("**Answer:** 42", "42"),
        ("I think it is 5", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_math_reward_uses_math_verify():
    assert math_reward("Answer: 56", "56") == 1.0
    assert math_reward("Answer: 56.0", "56") == 1.0
    assert math_reward("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("Answer: 55", "56") == 0.0
    assert math_reward("56", "56") == 0.0  # no committed answer, no reward
    assert math_reward("Answer: ???", "56") == 0.0
