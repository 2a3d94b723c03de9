"""Arithmetic tasks and the math reward: what the RL loop will train on."""

from __future__ import annotations

import pytest

from specroll.tasks import LEVELS, extract_answer, generate_problems, math_reward


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


@pytest.mark.parametrize(
    "record,message",
    [
        ({"prompt": ["a", "b"]}, "chat messages"),  # a list of strings, not messages
        ({"prompt": [{"role": "user", "content": ["x"]}]}, "content"),
        ({"prompt": {"text": "hi"}}, "'prompt' must be a string"),
        ({"prompt": 3}, "'prompt' must be a string"),
        ({"prompt": None}, "'prompt' must be a string"),
        ({"prompt": "  "}, "'prompt' is empty"),
        ({"prompt": []}, "no user message"),
        ({"prompt": "hi", "answer": [1]}, "'answer' must be a string or a number"),
        ({"prompt": "hi", "answer": {"a": 1}}, "'answer' must be a string or a number"),
        ({"prompt": "hi", "reward_model": "4"}, "'reward_model' must be an object"),
        ({"prompt": "hi", "reward_model": {"ground_truth": [4]}}, "'ground_truth' must be"),
        (["prompt"], "expected a JSON object"),
        (7, "expected a JSON object"),
    ],
)
def test_malformed_task_records_are_clear_errors(tmp_path, record, message):
    """A bad line names the file, the line and the field instead of raising a traceback."""
    import json

    from specroll.tasks.sets import load_file

    f = tmp_path / "tasks.jsonl"
    f.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ValueError, match="tasks.jsonl:2") as e:
        load_file(f)
    assert message in str(e.value)


def test_numeric_answers_and_chat_prompts_are_accepted(tmp_path):
    import json

    from specroll.tasks.sets import load_file

    f = tmp_path / "tasks.jsonl"
    recs = [
        {"prompt": "1+1?", "answer": 2},
        {"prompt": "half?", "answer": 0.5},
        {"prompt": "none?", "answer": None},
        {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
        "a bare string",
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = [(p.prompt, p.answer) for p in load_file(f)]
    assert got == [("1+1?", "2"), ("half?", "0.5"), ("none?", ""), ("q", ""), ("a bare string", "")]
