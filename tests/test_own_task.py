"""Bring your own task (issue 31), end to end on the tiny preset: the GSM8K example
(`examples/gsm8k`: its data, its reward module, its config) trains and logs each reward
component and the validation accuracy per data source; a resumed run with a user reward
repeats the uninterrupted one (slow); a failing reward function fails its step before any
update; a first step with no reward at all says why."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import make_trainer, train_tiny

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "gsm8k"
SMALL = ("data.prompts_per_step=2", "data.group_size=2", "rollout.max_new_tokens=8")
"""Settings that keep a tiny step to a few seconds."""


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _example_overrides() -> list[str]:
    """The example's config as section.key=value overrides (what --config layers)."""
    raw = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    return [f"{s}.{k}={json.dumps(v)}" for s, kv in raw.items() for k, v in kv.items()]


def _config_args() -> list[str]:
    """`--config FILE` where `specroll train` has it, else the same settings as --set."""
    from specroll.cli import build_parser

    train = build_parser()._subparsers._group_actions[0].choices["train"]
    if any("--config" in a.option_strings for a in train._actions):
        return ["--config", str(EXAMPLE / "config.yaml")]
    return [x for o in _example_overrides() for x in ("--set", o)]


@pytest.fixture(scope="module")
def example_run(tmp_path_factory) -> Path:
    """`specroll train --preset tiny --config examples/gsm8k/config.yaml --steps 2`, run
    from the repository root (the config's paths are relative to it)."""
    root = tmp_path_factory.mktemp("example")
    old_home, old_cwd = os.environ.get("SPECROLL_HOME"), os.getcwd()
    os.environ["SPECROLL_HOME"] = str(root / "home")
    os.chdir(ROOT)
    try:
        args = ["--steps", "2", *[x for s in SMALL for x in ("--set", s)], *_config_args()]
        assert train_tiny(root / "run", *args) == 0
    finally:
        os.chdir(old_cwd)
        if old_home is None:
            del os.environ["SPECROLL_HOME"]
        else:
            os.environ["SPECROLL_HOME"] = old_home
    return root / "run"


def test_the_example_config_is_short_and_its_data_is_gsm8k_shaped():
    assert len((EXAMPLE / "config.yaml").read_text().splitlines()) <= 5
    records = [json.loads(x) for x in (EXAMPLE / "train.jsonl").read_text().splitlines()]
    assert len(records) >= 24
    assert all(r["answer"].splitlines()[-1].startswith("#### ") for r in records)


def test_the_gsm8k_example_trains_and_logs_each_reward_and_source(example_run):
    rows = _rows(example_run)
    steps = [r for r in rows if "time" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for key in (
            "reward/math",
            "reward/gsm8k_reward",
            "reward/gsm8k_reward/correct",
            "reward/gsm8k_reward/marked",
        ):
            assert 0 <= r[key] <= 1.1, key
    val = rows[-1]
    sources = {k for k in val if k.startswith("val_accuracy/")}
    assert sources == {f"val_accuracy/gsm8k-{k}" for k in ("shopping", "sharing", "saving")}
    report = (example_run / "report.md").read_text()
    assert "examples/gsm8k/train.jsonl" in report and "gsm8k_reward" in report


def _trainer(out: Path, *overrides: str):
    from specroll.cli.common import load_dir, resolve_model_dir
    from specroll.rl.config import build_config
    from specroll.rl.run.draft import build_draft
    from specroll.rl.run.trainer import Trainer

    cfg = build_config("tiny", [f"pipeline.out_dir={out}", *overrides])
    path = resolve_model_dir(cfg.policy.model)
    policy, tok = load_dir(path)
    return Trainer(cfg, policy, tok, build_draft(cfg, policy, tok, path), log=lambda s: None)


@pytest.mark.slow  # two more tiny runs (~40 s on a busy 2-core machine)
def test_a_resumed_run_with_a_user_reward_repeats_the_uninterrupted_one(
    example_run, tmp_path, monkeypatch
):
    from tests.test_hostile_run import _comparable, _stop_with

    monkeypatch.setenv("SPECROLL_HOME", str(example_run.parent / "home"))
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    settings = ["pipeline.steps=2", *SMALL, *_example_overrides()]
    with pytest.raises(KeyboardInterrupt, match="step-000001"):
        _trainer(out, *settings).run(on_step=_stop_with(signal.SIGTERM, at=1))
    _trainer(out, *settings).run(resume=True)
    assert _comparable(_rows(out)) == _comparable(_rows(example_run))


HOSTILE = """
import math
from pathlib import Path

def fn(prompt, completion, record):
    mode = Path(__file__).with_name("mode.txt").read_text().strip()
    if mode == "raises":
        return {}["no such key"]
    if mode == "hangs":
        while True:
            pass
    if mode == "nan":
        return math.nan
    if mode == "type":
        return [1.0]
    if mode == "zero":
        return 0.0
    return sum(map(ord, completion)) % 3  # fine, and different across a group
"""


def test_a_failing_reward_function_fails_its_step_before_any_update(tiny_setup, tmp_path):
    """Each hostile case fails step 1 in the reward stage and leaves the policy as it was;
    then a first step that earns nothing at all warns, naming the likely cause (answers
    the math reward cannot read); a good step does update (so the check can fail)."""
    from specroll.tasks.rewards import RewardError

    (tmp_path / "hostile.py").write_text(HOSTILE)
    mode = tmp_path / "mode.txt"
    data = tmp_path / "words.jsonl"  # answers no extractor can read
    data.write_text(
        "".join(
            json.dumps({"prompt": f"How many {i}?", "answer": "about seventy"}) + "\n"
            for i in range(12)
        )
    )
    ref = f"reward.functions=[math, {tmp_path / 'hostile.py'}:fn]"
    logged: list[str] = []
    t = make_trainer(
        tiny_setup,
        tmp_path / "run",
        ref,
        f"data.train={data}",
        "reward.timeout_s=1",
        *SMALL,
        log=logged.append,
    )
    policy = t.host.learner.policy

    def snapshot() -> dict:
        return {k: v.detach().clone() for k, v in policy.state_dict().items()}

    before = snapshot()
    try:
        for case, needle in [
            ("raises", "raised KeyError: 'no such key'"),
            ("hangs", "did not return within reward.timeout_s=1.0 s"),
            ("nan", "returned nan"),
            ("type", "returned list [1.0]"),
        ]:
            mode.write_text(case)
            with pytest.raises(RewardError, match="reward function 'fn'") as e:
                t.run_step()
            assert needle in str(e.value) and "on record words.jsonl:" in str(e.value)
            assert t.step == 0
            after = snapshot()
            assert all(torch.equal(before[k], after[k]) for k in before), case
        assert not [x for x in logged if x.startswith("warning")]
        mode.write_text("zero")
        t.run_step()
        warning = [x for x in logged if x.startswith("warning: every reward of the first")]
        assert len(warning) == 1, logged
        assert "'about seventy'" in warning[0] and "data.answer_key" in warning[0]
        mode.write_text("fine")
        t.run_step()
        assert t.step == 2 and len([x for x in logged if x.startswith("warning")]) == 1
        assert not all(torch.equal(before[k], v) for k, v in snapshot().items())
    finally:
        t.close()


def test_the_user_sees_the_function_the_record_and_the_traceback(home, tmp_path, capsys):
    (tmp_path / "hostile.py").write_text(HOSTILE)
    (tmp_path / "mode.txt").write_text("raises")
    out = tmp_path / "run"
    args = [x for s in SMALL for x in ("--set", s)]
    code = train_tiny(out, "--set", f"reward.functions=[{tmp_path / 'hostile.py'}:fn]", *args)
    err = capsys.readouterr().err
    assert code == 2
    lines = err.splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("error: "))
    assert " ".join(lines[first:]).count("error:") == 1
    head = " ".join(" ".join(lines[first:]).split())
    assert "error: step 1: reward function 'fn' (" in head
    assert "raised KeyError: 'no such key' on record" in head
    assert "no update was applied" in head and "--resume" in head
    assert 'hostile.py", line 8, in fn' in err  # the user's own frame
    assert (out / "checkpoints" / "step-000000").is_dir()
