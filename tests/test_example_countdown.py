"""The bring-your-own-task example (examples/countdown): its data, its reward, its run.

A user copies this example to start their own task, so what it promises is tested: every
record is solvable, the committed data is what its script writes, the reward pays exactly
for a right equation and never runs the model's text, and a run trains on it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "countdown"
DATA = EXAMPLE / "countdown.jsonl"
REWARD = EXAMPLE / "reward.py"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"countdown_{name}", EXAMPLE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _records() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines()]


def test_the_committed_data_is_what_make_data_writes():
    assert _records() == _module("make_data").records(len(_records()))


def test_every_record_is_solvable_and_its_solution_earns_the_full_reward():
    countdown = _module("reward").countdown
    recs = _records()
    for r in recs:
        assert 1 <= r["target"] <= 200 and all(1 <= n <= 25 for n in r["numbers"]), r
        got = countdown(r["prompt"], f"Let me think.\nAnswer: {r['solution']}", r)
        assert got == {"format": 0.1, "correct": 1.0}, r
    assert {r["data_source"] for r in recs} == {"countdown-2", "countdown-3", "countdown-4"}


RECORD = {"numbers": [3, 5, 2], "target": 16}


@pytest.mark.parametrize(
    ("completion", "correct"),
    [
        ("Answer: (3 + 5) * 2", 1.0),
        ("(5+3)*2 works.\nAnswer: 2 * (5 + 3) = 16.", 1.0),  # '= target' and the stop
        ("so \\boxed{(3 + 5) × 2}", 1.0),
        ("Answer: 3 + 5 * 2", 0.0),  # 13
        ("Answer: (3 + 5) * 2 * 1", 0.0),  # a number it was not given
        ("Answer: (5 + 5 + 3 + 3) / 2 * 2", 0.0),  # numbers used twice
        ("Answer: 16", 0.0),  # the value without the equation
        ("Answer: 8 * 2", 0.0),  # 8 is not one of the numbers
    ],
)
def test_the_reward_pays_for_the_numbers_each_used_once_reaching_the_target(completion, correct):
    got = _module("reward").countdown("", completion, RECORD)
    assert got == {"format": 0.1, "correct": correct}


@pytest.mark.parametrize(
    "completion",
    [
        "no answer line at all",
        "Answer: three plus five, times two",
        "Answer: 2 ** 4",  # powers are not allowed (nor affordable: 9 ** 9 ** 9)
        "Answer: -3 + 5 * 2 + 9",  # unary minus
        "Answer: (3 + 5) / (2 - 2)",  # division by zero
        "Answer: 3.0 + 5 * 2.6",
        "Answer: __import__('os').system('touch PWNED')",
        "Answer: " + "(" * 150 + "1" + ")" * 150,  # too long to be an equation
    ],
)
def test_text_that_is_no_equation_earns_nothing_and_is_never_run(completion, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = _module("reward").countdown("", completion, RECORD)
    assert got == {"format": 0.0, "correct": 0.0}
    assert not (tmp_path / "PWNED").exists()


def test_the_example_config_names_the_data_and_the_reward(monkeypatch):
    """`--preset examples/countdown/config.yaml` from the repository root is a valid run
    (the file exists, the reward function is defined in reward.py)."""
    from specroll.rl.config import build_config

    monkeypatch.chdir(EXAMPLE.parent.parent)
    cfg = build_config(str(EXAMPLE.relative_to(Path.cwd()) / "config.yaml"))
    assert Path(cfg.data.train).resolve() == DATA
    assert cfg.reward.functions == ("examples/countdown/reward.py:countdown",)


def test_a_tiny_run_trains_on_the_example_and_logs_its_reward_parts(home, tmp_path, monkeypatch):
    """The example README's smoke command (one step, no validation, to stay fast)."""
    from tests.conftest import train_tiny

    monkeypatch.chdir(EXAMPLE.parent.parent)  # the paths as the README gives them
    out = tmp_path / "run"
    sets = [
        "data.train=examples/countdown/countdown.jsonl",
        "reward.functions=[examples/countdown/reward.py:countdown]",
        "data.val_size=0",
        "data.prompts_per_step=2",
    ]
    assert train_tiny(out, "--steps", "1", *[a for s in sets for a in ("--set", s)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [step] = [r for r in rows if "reward" in r]
    parts = step["reward/countdown/format"] + step["reward/countdown/correct"]
    assert step["reward"] == pytest.approx(parts, abs=1e-3)  # each part logged; they sum
