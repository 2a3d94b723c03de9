"""The reward stage under hostile use (issue 44, items 3, 10, 11 and the reward lows): a
completion is the policy's text and a reward module is the user's code, so scoring takes
time linear in the text, runs under `reward.timeout_s` (the built-ins too), stops on a
signal at once, leaves no process behind, and every value, name and import is bounded
and refused in one line naming the function."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from specroll.rl.config import build_config
from specroll.tasks import reward_worker
from specroll.tasks.rewards import RewardError, RewardSet, Sample

ROOT = Path(__file__).resolve().parent.parent


def _sample(completion: str, where: str = "train.jsonl:3") -> Sample:
    return Sample("How many?", completion, {"answer": "72"}, where)


def _module(tmp_path: Path, body: str, name: str = "rw.py") -> str:
    f = tmp_path / name
    f.write_text(textwrap.dedent(body))
    return str(f)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _wait_for(path: Path, seconds: float = 20.0) -> str:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.02)
    raise AssertionError(f"{path} never written")


# ---------------------------------------------------------------- item 3: linear time

ADVERSARIAL = {
    "blank lines": "\n".join([" " * 80] * 12_945),  # the issue's: 64 lines took 2.2 s
    "spaces inside an answer line": "Answer: 1" + " " * (1 << 20) + "x",
    "labels that never get a colon": ("Answer" + " " * 73 + "\n") * 13_107,
    "an unclosed box": "\\boxed{" + "{" * (1 << 20),
    "a 1 MB answer for math-verify": "Answer: " + "1+" * (1 << 19) + "1",
    "a 1 MB nested box": "\\boxed{" + "(" * (1 << 19) + "1" + ")" * (1 << 19) + "}",
}

CHILD = """
import json, sys, time
from specroll.tasks.reward import BUILTINS
texts = json.load(sys.stdin)
for fn in BUILTINS.values():
    fn("p", "Answer: 3", {"answer": "72"})  # imports (math-verify) are not timed
worst = {}
for name, text in texts.items():
    for fn in BUILTINS.values():
        t0 = time.perf_counter()
        fn("p", text, {"answer": "72"})
        worst[name] = max(worst.get(name, 0.0), time.perf_counter() - t0)
print(json.dumps(worst))
"""


def test_each_builtin_scores_a_1mb_adversarial_completion_in_linear_time():
    """Every built-in on each 1 MB completion in well under a second (the extractor used
    to backtrack across lines: cubic, hours for 1 MB); in a child process, so a slow
    extractor fails the test at its timeout instead of hanging it."""
    p = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(ADVERSARIAL),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    worst = json.loads(p.stdout)
    assert all(s < 0.5 for s in worst.values()), worst  # ~0.01-0.06 s here


# ------------------------------------------------- item 3: the timeout, and signals


def test_a_builtin_reward_runs_under_reward_timeout_s():
    """math-verify takes seconds on a short tower of powers: the built-in is stopped by
    reward.timeout_s like a user function, naming itself and the record."""
    rs = RewardSet(("math",), timeout_s=0.5)
    tower = "Answer: " + "x^" * 40 + "2"
    t0 = time.perf_counter()
    try:
        with pytest.raises(RewardError) as e:
            rs.score([_sample(tower, where="train.jsonl:9")])
        assert time.perf_counter() - t0 < 10
    finally:
        rs.close()
    msg = str(e.value)
    assert msg.startswith("reward function 'math' did not return within reward.timeout_s=0.5 s")
    assert "on record train.jsonl:9" in msg


SLOW_ONCE = """
import os, time
from pathlib import Path

def fn(prompt, completion, record):
    marker = Path(__file__).with_name("started")
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        time.sleep(8)
    return 0.0
"""


@pytest.mark.parametrize("val_size", [0, 2], ids=["step", "validation_at_start"])
def test_sigterm_during_the_reward_stage_stops_the_run_at_once(tiny_setup, tmp_path, val_size):
    """The first SIGTERM stops a reward stage that is still computing within a second,
    saves the last completed step and kills the worker (it used to finish the stage): the
    step's scoring, and the validation before the first step (nothing is lost by stopping
    it: a resumed run validates again)."""
    from tests.conftest import make_trainer

    path = _module(tmp_path, SLOW_ONCE)
    t = make_trainer(
        tiny_setup,
        tmp_path / "run",
        f"reward.functions=[{path}:fn]",
        "pipeline.steps=1",
        f"data.val_size={val_size}",
        "data.prompts_per_step=2",
        "data.group_size=2",
        "rollout.max_new_tokens=4",
    )
    sent: list[float] = []

    def signal_when_scoring() -> None:
        _wait_for(tmp_path / "started", 120)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=signal_when_scoring, daemon=True)
    killer.start()
    try:
        with pytest.raises(KeyboardInterrupt) as stop:
            t.run()
        stopped = time.monotonic()
    finally:
        t.close()
    killer.join(5)
    assert stop.value.signum == signal.SIGTERM and "step-000000" in str(stop.value)
    assert stopped - sent[0] < 3.0  # the function would have slept 8 s
    assert _gone_within(int((tmp_path / "started").read_text()), 3)


def test_a_stop_request_abandons_the_batch_and_the_next_call_works(tmp_path):
    path = _module(
        tmp_path,
        """
        import time
        def fn(prompt, completion, record):
            if completion == "slow":
                time.sleep(30)
            return 1.0
        """,
    )
    rs = RewardSet((f"{path}:fn",), timeout_s=60)
    t0 = time.perf_counter()

    def stop() -> None:
        if time.perf_counter() - t0 > 0.3:
            raise KeyboardInterrupt

    try:
        with pytest.raises(KeyboardInterrupt):
            rs.score([_sample("slow")], stop)
        assert time.perf_counter() - t0 < 3
        assert rs.score([_sample("fast")]).total == [1.0]  # a fresh worker
    finally:
        rs.close()


# ------------------------------------------------------ item 10: no process left behind

LINGERING = """
import os, threading, time
from pathlib import Path

threading.Thread(target=lambda: time.sleep(3600)).start()  # not a daemon

def fn(prompt, completion, record):
    Path(__file__).with_name("pid").write_text(str(os.getpid()))
    while completion == "forever":
        time.sleep(0.1)
    return 1.0
"""

OWNER = """
import os, signal, sys
from specroll.tasks.rewards import RewardSet, Sample

module, how = sys.argv[1], sys.argv[2]
rs = RewardSet((module + ":fn",))
rs.start()
text = "forever" if how == "killed" else "once"
rs.score([Sample("p", text, {}, "r:1")])
if how == "raises":
    raise RuntimeError("the run failed")
if how == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
"""


@pytest.mark.parametrize("how", ["ends", "raises", "signal", "killed"])
def test_the_reward_worker_never_outlives_its_process(tmp_path, how):
    """A module that leaves a non-daemon thread running used to keep the worker alive
    (parent 1) after the run; whether the run ends, fails, is stopped by a signal or
    killed in the middle of a call, its worker ends with it."""
    path = _module(tmp_path, LINGERING)
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, path, how],
        cwd=ROOT,
        stderr=subprocess.DEVNULL,
    )
    pid = int(_wait_for(tmp_path / "pid"))
    try:
        if how == "killed":
            owner.kill()
        owner.wait(timeout=30)
        assert _gone_within(pid, 5), "the reward worker outlived its process"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        owner.kill()


# --------------------------------------------------------- item 11 and reward values


@pytest.mark.parametrize(
    "setting,needle",
    [
        ("reward.timeout_s=1e10", "reward.timeout_s must be at most 3600"),
        ("reward.weights=[1e300]", "reward.weights must be finite numbers within +-1e+06"),
    ],
)
def test_reward_settings_are_bounded(setting, needle):
    with pytest.raises(ValueError, match=needle.replace("+", r"\+")):
        build_config("tiny", [setting])


VALUES = """
def fn(prompt, completion, record):
    return {
        "big int": 10**400,
        "huge": 1e308,
        "many": {f"c{i}": 0.0 for i in range(33)},
        "name": {completion + " as a metric!": 1.0},
    }[completion]

def varying(prompt, completion, record):
    return {completion: 1.0}
"""


@pytest.mark.parametrize(
    "completion,needle",
    [
        ("big int", "returned 100000000000"),
        ("huge", "returned 1e+308 (rewards must be finite, within +-1e+06"),
        ("many", "returned a dict of 33 components, more than 32"),
        ("name", "returned a component named 'name as a metric!'"),
    ],
)
def test_a_reward_value_out_of_bounds_is_refused_naming_the_function(tmp_path, completion, needle):
    """10**400 used to kill the worker with an internal traceback, 1e308 to pass and
    make the loss NaN, and any dict to become metrics."""
    path = _module(tmp_path, VALUES)
    rs = RewardSet((f"{path}:fn",))
    try:
        with pytest.raises(RewardError) as e:
            rs.score([_sample(completion, where="data.jsonl:4")])
    finally:
        rs.close()
    msg = str(e.value)
    assert msg.startswith(f"reward function 'fn' ({path}:fn) ") and needle in msg, msg
    assert "on record data.jsonl:4" in msg and "\n" not in msg


def test_components_are_bounded_over_a_step_too(tmp_path):
    path = _module(tmp_path, VALUES)
    rs = RewardSet((f"{path}:varying",))
    try:
        with pytest.raises(RewardError, match="33 different component names .* more than 32"):
            rs.score([_sample(f"k{i}") for i in range(33)])
    finally:
        rs.close()


def test_a_reward_function_over_the_memory_bound_fails_as_itself(tmp_path):
    """9 GiB reserved (never touched) is past the worker's 8 GiB of address space."""
    path = _module(
        tmp_path,
        """
        import numpy as np
        def fn(prompt, completion, record):
            return float(np.empty(9 << 30, dtype=np.uint8)[:1].size)
        """,
    )
    rs = RewardSet((f"{path}:fn",))
    try:
        with pytest.raises(RewardError) as e:
            rs.score([_sample("x")])
    finally:
        rs.close()
    assert "raised MemoryError: more than the reward worker's 8 GiB" in str(e.value)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ reward loading


def test_a_module_that_hangs_at_import_fails_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(reward_worker, "IMPORT_MIN_S", 1.0, raising=False)
    monkeypatch.setattr(reward_worker, "LOAD_TIMEOUT_S", 3.0, raising=False)  # (the old bound)
    path = _module(tmp_path, "import time\ntime.sleep(3600)\ndef fn(p, c, r):\n    return 0\n")
    rs = RewardSet((f"{path}:fn", "math"), timeout_s=1.0)
    t0 = time.perf_counter()
    with pytest.raises(RewardError) as e:
        rs.start()
    rs.close()
    assert time.perf_counter() - t0 < 8
    assert str(e.value) == (
        f"reward.functions: importing '{path}:fn' did not finish within 1 s (reward.timeout_s, "
        f"at least 1 s for an import): a reward module must not wait or loop when it is "
        f"imported"
    )


def test_the_same_function_named_two_ways_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rw").mkdir()
    _module(tmp_path / "rw", "def f(p, c, r):\n    return 1.0\n", "x.py")
    with pytest.raises(ValueError) as e:
        build_config("tiny", ["reward.functions=[rw/x.py:f, ./rw/x.py:f]"])
    assert "names one function twice: 'rw/x.py:f' and './rw/x.py:f'" in str(e.value)
    build_config("tiny", ["reward.functions=[rw/x.py:f, math]"])  # once is fine


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("deep", "is nested too deeply for Python to parse (RecursionError)"),
        ("alias", "'os' is a module, not a package, so 'os.path' is no module file"),
        ("fifo", "pipe.py is a FIFO (named pipe), not a Python file"),
    ],
)
def test_reward_references_that_cannot_be_checked_say_why_in_one_line(
    home, tmp_path, capsys, kind, needle
):
    """A 200,000-term expression (was a RecursionError traceback), an alias module (was
    'no module') and a FIFO (was 'no such file') each get one line saying what it is."""
    from tests.conftest import fails_clearly

    if kind == "deep":
        terms = "+".join(["1"] * 200_000)
        ref = _module(tmp_path, f"x = {terms}\ndef f(p, c, r):\n    return 0\n") + ":f"
    elif kind == "alias":
        ref = "os.path:join"
    else:
        os.mkfifo(tmp_path / "pipe.py")
        ref = f"{tmp_path / 'pipe.py'}:f"
    argv = ["train", "--preset", "tiny", "--out", str(tmp_path / "r")]
    fails_clearly(capsys, [*argv, "--set", f"reward.functions=[{ref}]"], needle)
