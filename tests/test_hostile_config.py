"""Hostile use of the settings and the command-line numbers (issue 44, part C): every
setting that sizes memory or a loop has an upper bound checked before any model loads,
YAML cannot expand beyond a small bound or read numbers the YAML 1.1 way, a `--set` value
that is not YAML is one line that says how to quote it, `generate --out` replaces no
input and no file without --overwrite, seeds and temperatures are refused where torch
could not use them, and validation is called what it is."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import pytest

from specroll.cli import main
from specroll.rl.config import build_config, max_seed
from tests.conftest import fails_clearly

TINY = ["--model", "tiny"]
FEW = ["--prompt", "hi", "--max-new-tokens", "2"]


@pytest.fixture
def home(tmp_path_factory, monkeypatch) -> Path:
    """One SPECROLL_HOME for this module, so the tiny model is built once."""
    home = tmp_path_factory.getbasetemp() / "hostile-config-home"
    monkeypatch.setenv("SPECROLL_HOME", str(home))
    return home


@pytest.fixture
def no_model(monkeypatch) -> None:
    """Any model load fails the test: the check under test must come first."""
    from specroll.cli import common

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    for name in ("load_policy", "load_dir", "resolve_model_dir"):
        monkeypatch.setattr(common, name, refuse)


def _train(out: Path, *sets: str) -> list[str]:
    argv = ["train", "--preset", "tiny", "--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    return argv


# ------------------------------------------------ 4. settings that size memory or loops


@pytest.mark.parametrize(
    "setting,needles",
    [
        ("data.val_size=18446744073709551616", ["data.val_size", "<= 100000"]),
        ("data.pool=18446744073709551616", ["data.pool", "<= 100000", "math task"]),
        ("pipeline.seed=9223372036854775808", ["pipeline.seed", f"[0, {max_seed()}]"]),
        ("pipeline.seed=-1", ["pipeline.seed"]),
        ("pipeline.steps=10000000", ["pipeline.steps", "<= 1000000"]),
        ("pipeline.max_lag=100000000", ["pipeline.max_lag", "<= 64"]),
        ("ray.workers=1000000000", ["ray.workers", "<= 1024"]),
        ("loss.updates_per_step=1000000000", ["loss.updates_per_step", "= 16"]),
        ("rollout.temperature=1e-40", ["rollout.temperature", ">= 0.0001"]),
        ("rollout.top_k=9223372036854775808", ["rollout.top_k", "<= 16777216"]),
    ],
)
def test_unbounded_settings_fail_before_any_model_loads(
    capsys, tmp_path, no_model, setting, needles
):
    fails_clearly(capsys, _train(tmp_path / "run", setting), *needles)


def test_the_largest_seed_is_accepted_and_its_rollout_seeds_fit():
    from specroll.rl.config import MAX_STEPS
    from specroll.rl.run.task import REQUESTS_PER_STEP, step_seed
    from specroll.spec.rng import SEED_LIMIT

    cfg = build_config("tiny", [f"pipeline.seed={max_seed()}"])
    last = (step_seed(cfg.pipeline.seed, MAX_STEPS) + 1) * REQUESTS_PER_STEP - 1
    assert last < SEED_LIMIT


def test_a_file_pool_may_be_larger_than_the_math_pool(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": "1"}) + "\n" for i in range(9)))
    assert build_config("tiny", [f"data.train={f}", "data.pool=0"]).data.pool == 0
    with pytest.raises(ValueError, match=r"data.pool must be <= 1000000 \(0 = "):
        build_config("tiny", [f"data.train={f}", "data.pool=1000001"])


# ------------------------------------------------ 5. YAML that expands or nests without end


def _bomb(levels: int) -> str:
    """A mapping whose last list expands to 10**levels values through aliases."""
    lines = ["data:", "  chat_template_kwargs:", "    l0: &l0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        refs = ", ".join([f"*l{i - 1}"] * 10)
        lines.append(f"    l{i}: &l{i} [{refs}]")
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_before_it_expands(capsys, tmp_path, no_model):
    small = tmp_path / "small.yaml"
    small.write_text(_bomb(6))  # 10**6 values from 400 bytes
    big = tmp_path / "big.yaml"
    big.write_text(_bomb(9))  # 10**9: gigabytes if it were expanded
    for path in (small, big):
        t0 = time.monotonic()
        fails_clearly(
            capsys, ["config", "--preset", "tiny", "--config", str(path)], str(path), "aliases"
        )
        assert time.monotonic() - t0 < 2
    fails_clearly(capsys, [*_train(tmp_path / "run"), "--config", str(big)], str(big), "alias")
    bomb = "{a: &a [1,1,1,1,1,1,1,1,1,1], b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], "
    bomb += "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], d: [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]}"
    fails_clearly(
        capsys, _train(tmp_path / "run", f"data.chat_template_kwargs={bomb}"), "--set", "aliases"
    )


def test_a_little_reuse_through_aliases_still_works(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  chat_template_kwargs: &kw {enable_thinking: off, mode: &m fast}\n")
    f.write_text(f.read_text() + "  system_prompt: *m\n")
    cfg = build_config("tiny", configs=(str(f),))
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False, "mode": "fast"}
    assert cfg.data.system_prompt == "fast"


@pytest.mark.parametrize(
    "text,needles",
    [
        ("data:\n  chat_template_kwargs: &a {x: *a}\n", ["contains itself"]),
        ("data:\n  chat_template_kwargs: {x: " + "[" * 5000 + "]" * 5000 + "}\n", ["nested"]),
    ],
)
def test_self_reference_and_deep_nesting_are_one_line(capsys, tmp_path, no_model, text, needles):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    fails_clearly(capsys, ["config", "--preset", "tiny", "--config", str(f)], str(f), *needles)


def test_a_huge_config_file_is_refused_unread(capsys, tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  system_prompt: " + "x" * (2 << 20) + "\n")
    fails_clearly(capsys, ["config", "--preset", "tiny", "--config", str(f)], str(f), "larger than")


def test_chat_template_kwargs_are_small_plain_json(capsys, tmp_path, no_model):
    huge = "x" * (65 << 10)
    fails_clearly(
        capsys,
        _train(tmp_path / "run", f"data.chat_template_kwargs={{a: {huge}}}"),
        "data.chat_template_kwargs",
        "at most 65536 bytes",
    )
    fails_clearly(
        capsys,
        _train(tmp_path / "run", "data.chat_template_kwargs={a: !!binary aGk=}"),
        "data.chat_template_kwargs",
        "only strings",
    )


# ------------------------------------------------ 6. a --set value that is not YAML


@pytest.mark.parametrize(
    "key,text",
    [
        ("data.system_prompt", "Format: Answer: N"),
        ("data.system_prompt", "@x"),
        ("data.system_prompt", "%TAG"),
        ("data.system_prompt", "`ls`"),
        ("data.levels", "[1,"),
        ("data.system_prompt", "!!python/object/apply:os.system [touch PWNED]"),
        ("data.response_prefix", 'it\'s: "quoted": here'),
    ],
)
def test_a_set_value_that_is_not_yaml_says_how_to_quote_it(capsys, tmp_path, key, text):
    text = text.replace("PWNED", str(tmp_path / "pwned"))
    line = fails_clearly(capsys, ["config", "--preset", "tiny", "--set", f"{key}={text}"], key)
    assert "not valid YAML" in line and f"{text!r}" in line
    assert not (tmp_path / "pwned").exists()
    suggested = shlex.split(line.rsplit("--set ", 1)[1])
    assert len(suggested) == 1
    section, name = key.split(".")
    if name != "levels":  # the quoted form is the text itself
        cfg = build_config("tiny", [suggested[0]])
        assert getattr(getattr(cfg, section), name) == text


# ------------------------------------------------ low: numbers read as YAML 1.2


@pytest.mark.parametrize(
    "setting,value",
    [
        ("pipeline.steps=010", 10),  # YAML 1.1: octal 8
        ("pipeline.steps=0o10", 8),
        ("pipeline.steps=0x10", 16),
        ("pipeline.steps=+3", 3),
        ("policy.lr=3e-3", 0.003),  # YAML 1.1: the string '3e-3'
        ("policy.lr=1E-4", 1e-4),
        ("log.run_name=2001-12-14", "2001-12-14"),  # YAML 1.1: a date
        ("log.run_name=1:30", "1:30"),
    ],
)
def test_numbers_are_read_as_yaml_1_2(setting, value, tmp_path):
    key, text = setting.split("=")
    section, name = key.split(".")
    assert getattr(getattr(build_config("tiny", [setting]), section), name) == value
    f = tmp_path / "c.yaml"
    f.write_text(f"{section}:\n  {name}: {text}\n")
    assert getattr(getattr(build_config("tiny", configs=(str(f),)), section), name) == value


@pytest.mark.parametrize("text", ["1:30", "1_000", "0b11"])
def test_yaml_1_1_number_forms_are_refused_by_numeric_settings(capsys, text):
    line = fails_clearly(capsys, ["config", "--preset", "tiny", "--set", f"pipeline.steps={text}"])
    assert "pipeline.steps must be int" in line and repr(text) in line


def test_config_output_reads_back_as_the_same_settings(capsys, tmp_path):
    sets = ["log.run_name='1e3'", "data.system_prompt='0o17'", "policy.lr=3e-3"]
    assert main(["config", "--preset", "tiny", *(a for s in sets for a in ("--set", s))]) == 0
    f = tmp_path / "c.yaml"
    f.write_text(capsys.readouterr().out)
    cfg = build_config("tiny", configs=(str(f),))
    assert (cfg.log.run_name, cfg.data.system_prompt, cfg.policy.lr) == ("1e3", "0o17", 0.003)


# ------------------------------------------------ 7. generate --out


def test_generate_out_never_replaces_an_input_nor_a_file_unasked(capsys, tmp_path, home, no_model):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n")
    before = prompts.read_text()
    link = tmp_path / "link.txt"
    link.symlink_to(prompts)
    base = ["generate", *TINY, "--prompts", str(prompts), "--max-new-tokens", "2"]
    for out in (prompts, link):
        for extra in ([], ["--overwrite"]):
            fails_clearly(capsys, [*base, "--out", str(out), *extra], "--out", "--prompts")
    other = tmp_path / "old.jsonl"
    other.write_text("keep\n")
    fails_clearly(capsys, [*base, "--out", str(other)], "--out", "already exists", "--overwrite")
    assert prompts.read_text() == before and other.read_text() == "keep\n"


def test_generate_overwrite_replaces_an_output(tmp_path, home):
    other = tmp_path / "old.jsonl"
    other.write_text("keep\n")
    assert main(["generate", *TINY, *FEW, "--out", str(other), "--overwrite"]) == 0
    assert json.loads(other.read_text().splitlines()[0])["prompt"] == "hi"


# ------------------------------------------------ low: temperatures and seeds


@pytest.mark.parametrize("value", ["1e-40", "1e-300", "nan", "inf", "-1"])
def test_generate_temperature_outside_what_fp32_holds(capsys, home, no_model, value):
    fails_clearly(
        capsys, ["generate", *TINY, *FEW, "--temperature", value], "--temperature", "0.0001"
    )


@pytest.mark.parametrize(
    "flags,needles",
    [
        (["--top-k", str(1 << 63)], ["--top-k", "[0, 16777216]"]),
        (["--samples", "100000000000"], ["--samples", "[1, 1048576]"]),
        (["--prompt", "a", "--samples", "700000"], ["2 prompts x --samples 700000", "at most"]),
    ],
)
def test_generate_sizes_are_bounded_before_loading(capsys, home, no_model, flags, needles):
    fails_clearly(capsys, ["generate", *TINY, *FEW, *flags], *needles)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", *TINY, *FEW, "--seed", str(1 << 63)],
        ["generate", *TINY, *FEW, "--seed", "-1"],
        ["draft", "data", "--policy", "tiny", "--out", "OUT", "--seed", str(1 << 62)],
        ["draft", "train", "--data", "missing", "--out", "OUT", "--seed", str(1 << 64)],
    ],
)
def test_seeds_are_bounded_before_any_model_loads(capsys, tmp_path, home, no_model, argv):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    fails_clearly(capsys, argv, "--seed", "[0, ")


def test_bench_temperature_is_checked_before_loading(capsys, no_model):
    fails_clearly(
        capsys, ["bench", "spec", *TINY, "--temperature", "1e-40"], "--temperature", "0.0001"
    )


# ------------------------------------------------ low: simulate's flags


@pytest.mark.parametrize(
    "flags,needles",
    [
        (["--prompts", "1000000000", "--samples", "1000000000"], ["--prompts", "[1, "]),
        (["--prompts", "100000", "--samples", "100"], ["--prompts x --samples", "at most"]),
        (["--prompts", "20000", "--samples", "16", "--lag", "8"], ["--lag 8", "at most"]),
        (["--mean-len", "nan"], ["--mean-len", "[1, "]),
        (["--mean-len", "inf"], ["--mean-len"]),
        (["--sigma", "nan"], ["--sigma"]),
        (["--max-len", "10000000000"], ["--max-len"]),
        (["--gpus", "100000000000"], ["--gpus"]),
        (["--lag", "65"], ["--lag", "[0, 64]"]),
        (["--draft-params", "inf"], ["--draft-params"]),
    ],
)
def test_simulate_flags_are_bounded(capsys, flags, needles):
    t0 = time.monotonic()
    fails_clearly(capsys, ["simulate", "--no-sweep", "--json", *flags], *needles)
    assert time.monotonic() - t0 < 5


# ------------------------------------------------ low: draft eval --k


@pytest.mark.parametrize(
    "flags,needles",
    [
        (["--k", "1,x"], ["--k", "comma-separated integers", "'1,x'"]),
        (["--k", "0"], ["--k", "[1, 64]"]),
        (["--batches", "1,y"], ["--batches", "comma-separated integers"]),
    ],
)
def test_draft_eval_lists_name_the_flag(capsys, no_model, flags, needles):
    fails_clearly(
        capsys, ["draft", "eval", "--policy", "tiny", "--draft", "ngram", *flags], *needles
    )


# ------------------------------------------------ low: validation is a mean reward


def test_validation_is_called_a_mean_reward(tmp_path):
    from specroll.rl.run.report import step_line, write_report

    t = {"gen": 1.0, "reward": 0.1, "logprob": 1.0, "train": 3.0, "prepare": 0.1}
    m = {"step": 1, "time": t, "step_s": 5.2, "reward": 3.0, "accuracy": 1.0}
    m.update(response_len_mean=4, gen_tok_s=10, val_accuracy=3.0, lag={"0": 4})
    line = step_line(m, 2)
    assert "val reward 3.000" in line and "accuracy 3" not in line
    write_report(tmp_path, [{"step": 0, "val_accuracy": 3.0}, m], build_config("tiny"))
    text = (tmp_path / "report.md").read_text()
    assert "| val reward |" in text and "val acc" not in text
    assert "`val_accuracy_start` / `val_accuracy_end`: the mean reward" in text
