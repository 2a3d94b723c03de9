"""Reward functions (issue 31): the built-ins, user functions with the one documented
signature run in their own process, weights and named components, and every way a user
function can go wrong failing clearly (naming the function and the record, with the
user's traceback) instead of hanging or training on garbage."""

from __future__ import annotations

import textwrap
import time

import pytest

from specroll.rl.config import build_config
from specroll.tasks.reward import BUILTINS, exact_match_reward, extract_answer, math_reward
from specroll.tasks.rewards import RewardError, RewardSet, Sample


def _sample(completion: str, answer: str = "72", where: str = "train.jsonl:3") -> Sample:
    return Sample("How many?", completion, {"answer": answer, "data_source": "s"}, where)


def _module(tmp_path, body: str, name: str = "my_reward.py") -> str:
    f = tmp_path / name
    f.write_text(textwrap.dedent(body))
    return str(f)


def test_builtins_read_gsm8k_answers_on_both_sides():
    gsm8k_gold = "She has 8 * 9 = 72 marbles.\n#### 72"
    assert math_reward("so 8 * 9 = 72\n#### 72", gsm8k_gold) == 1.0
    assert math_reward("Answer: 72", gsm8k_gold) == 1.0
    assert math_reward("#### 1,000", "1000") == 1.0
    assert math_reward("the answer is 72", gsm8k_gold) == 0.0  # no committed answer
    assert math_reward("#### 71", gsm8k_gold) == 0.0
    assert exact_match_reward("Answer: Paris.", "paris") == 1.0
    assert exact_match_reward("positive", "Positive") == 1.0  # no marker: the whole reply
    assert exact_match_reward("Answer: Lyon", "paris") == 0.0
    fmt = BUILTINS["format"]
    assert fmt("", "\\boxed{3}", {}) == fmt("", "#### 3", {}) == 1.0
    assert fmt("", "three", {}) == 0.0
    # the later of an Answer line and a #### line counts
    assert extract_answer("Answer: 5\nno wait\n#### 6") == "6"
    assert extract_answer("#### 6\nAnswer: 5") == "5"


def test_user_functions_return_floats_or_named_components_weighted(tmp_path):
    path = _module(
        tmp_path,
        """
        def graded(prompt, completion, record):
            return {"correct": float(record["answer"] in completion), "short": 0.5}

        def length(prompt, completion, record):
            return len(completion) / 100
        """,
    )
    rs = RewardSet(("format", f"{path}:graded", f"{path}:length"), (2.0, 1.0, -1.0))
    try:
        s = rs.score([_sample("#### 72"), _sample("no idea")])
    finally:
        rs.close()
    assert s.parts["format"] == [1.0, 0.0]
    assert s.parts["graded"] == [1.5, 0.5]  # the components' sum
    assert s.parts["graded/correct"] == [1.0, 0.0]
    assert s.parts["graded/short"] == [0.5, 0.5]
    assert s.parts["length"] == pytest.approx([0.07, 0.07])
    assert s.total == pytest.approx([2 * 1 + 1.5 - 0.07, 0 + 0.5 - 0.07])


def test_prints_in_a_reward_function_do_not_corrupt_the_results(tmp_path, capfd):
    path = _module(
        tmp_path,
        """
        import sys
        def noisy(prompt, completion, record):
            print("scoring", completion, '{"value": 99}')
            sys.stdout.flush()
            return 0.25
        """,
    )
    rs = RewardSet((f"{path}:noisy",))
    try:
        assert rs.score([_sample("a"), _sample("b")]).total == [0.25, 0.25]
    finally:
        rs.close()
    assert "scoring a" in capfd.readouterr().err


HOSTILE = {
    "raises": (
        """
        def fn(prompt, completion, record):
            return helper(record)

        def helper(record):
            return 1 / 0
        """,
        ["raised ZeroDivisionError: division by zero", "line 6, in helper", "1 / 0"],
    ),
    "hangs": (
        """
        import time
        def fn(prompt, completion, record):
            while True:
                time.sleep(0.05)
        """,
        ["did not return within reward.timeout_s=1.0 s"],
    ),
    "nan": (
        """
        def fn(prompt, completion, record):
            return float("nan")
        """,
        ["returned nan (rewards must be finite)"],
    ),
    "wrong type": (
        """
        def fn(prompt, completion, record):
            return "1.0"
        """,
        ["returned str '1.0' (expected a float or a dict of floats"],
    ),
    "bad component": (
        """
        def fn(prompt, completion, record):
            return {"ok": None}
        """,
        ["component 'ok' is NoneType None"],
    ),
    "exits": (
        """
        import os
        def fn(prompt, completion, record):
            os._exit(3)
        """,
        ["the reward worker process died (exit code 3)"],
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_reward_function_fails_clearly_and_the_next_call_works(tmp_path, case):
    """The error names the function, its file and the record (with its answer), carries
    the user's traceback where there is one, and comes within the timeout; the worker is
    usable afterwards (restarted if it had to be stopped)."""
    body, needles = HOSTILE[case]
    path = _module(tmp_path, textwrap.dedent(body) + "\ndef fine(p, c, r):\n    return 1\n")
    rs = RewardSet((f"{path}:fn",), timeout_s=1.0)
    t0 = time.perf_counter()
    try:
        with pytest.raises(RewardError) as e:
            rs.score(
                [_sample("ok", where="gsm8k.jsonl:1"), _sample("#### 5", where="gsm8k.jsonl:2")]
            )
        assert time.perf_counter() - t0 < 15
        msg = str(e.value)
        assert msg.startswith(f"reward function 'fn' ({path}:fn) ")
        assert "on record gsm8k.jsonl:1 (prompt 'How many?', answer '72')" in msg
        for needle in needles:
            assert needle in msg, msg
    finally:
        rs.close()
    again = RewardSet((f"{path}:fine",), timeout_s=1.0)
    try:
        assert again.score([_sample("x")]).total == [1.0]
    finally:
        again.close()


def test_a_module_that_fails_to_import_fails_at_start(tmp_path):
    path = _module(tmp_path, "import no_such_package_here\ndef fn(p, c, r):\n    return 0\n")
    rs = RewardSet((f"{path}:fn",))
    with pytest.raises(RewardError, match="cannot load .*ModuleNotFoundError.*no_such_package"):
        rs.start()
    rs.close()


@pytest.mark.parametrize(
    "ref,needles",
    [
        ("mathh", ["unknown built-in reward 'mathh'", "math, exact_match, format"]),
        ("missing.py:fn", ["'missing.py:fn': no such file missing.py"]),
        ("{mod}:nope", ["defines no 'nope'", "top-level names: fn"]),
        ("no_such_pkg_xyz.sub:fn", ["no module 'no_such_pkg_xyz'"]),
        ("{bad}:fn", ["is not valid Python (line 1"]),
        ("{mod}:not-a-name", ["must be 'path/to/file.py:function'"]),
    ],
)
def test_reward_functions_are_checked_without_running_them(tmp_path, ref, needles):
    mod = _module(tmp_path, "raise SystemExit('user code ran')\ndef fn(p, c, r):\n    return 0\n")
    bad = _module(tmp_path, "def fn(:\n", "bad.py")
    with pytest.raises(ValueError) as e:
        build_config("tiny", [f"reward.functions=[{ref.format(mod=mod, bad=bad)}]"])
    for needle in needles:
        assert needle in str(e.value)


def test_reward_settings_are_validated(tmp_path):
    mod = _module(tmp_path, "from helpers import *\n")  # star imports: benefit of the doubt
    build_config("tiny", [f"reward.functions=[math, {mod}:anything]"])
    build_config("tiny", ["reward.functions=[json:dumps]"])  # an importable module
    with pytest.raises(ValueError, match=r"one weight per reward.functions entry \(2\), got 1"):
        build_config("tiny", ["reward.functions=[math, format]", "reward.weights=[1]"])
    with pytest.raises(ValueError, match="reward.timeout_s must be > 0"):
        build_config("tiny", ["reward.timeout_s=0"])
    with pytest.raises(ValueError, match="names math more than once"):
        build_config("tiny", ["reward.functions=[math, math]"])
    with pytest.raises(ValueError, match="at least one"):
        build_config("tiny", ["reward.functions=[]"])


def test_a_bad_reward_reference_fails_before_any_model_loads(tmp_path, capsys):
    from tests.conftest import fails_clearly

    last = fails_clearly(
        capsys,
        [
            "train",
            "--preset",
            "tiny",
            "--out",
            str(tmp_path / "r"),
            "--set",
            "reward.functions=[math, exact]",
        ],
        "unknown built-in reward 'exact'",
    )
    assert "loading" not in last and not (tmp_path / "r").exists()


def test_the_all_zero_warning_names_the_likely_cause():
    rs = RewardSet(("math",))
    unreadable = rs.zero_hint([_sample("#### 5", answer="about seventy")])
    assert "'about seventy'" in unreadable and "data.answer_key" in unreadable
    no_format = rs.zero_hint([_sample("it is 72 I think", answer="#### 72")])
    assert "no completion commits to a final answer" in no_format
    assert "'it is 72 I think'" in no_format and "answer '72'" in no_format
    wrong = rs.zero_hint([_sample("Answer: 71", answer="72")])
    assert "read '71'" in wrong and "answer is '72'" in wrong
    assert "reward.functions (format)" in RewardSet(("format",)).zero_hint([_sample("x")])
