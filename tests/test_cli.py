"""The command line fails fast and clearly on bad input (exit code 2, message names it)."""

from __future__ import annotations

import pytest

from specroll.cli import main
from specroll.drafting import registry
from tests.conftest import fails_clearly


def test_bad_sampling_argument_names_the_field(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_unknown_model_is_a_clear_error(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_unknown_drafter_lists_the_kinds(tiny_model):
    with pytest.raises(ValueError, match="ngram"):
        registry.build("medusa", tiny_model)
    with pytest.raises(ValueError, match="eagle3:PATH"):
        registry.build("eagle3", tiny_model)  # a path is required


def test_draft_commands_check_inputs_first(capsys, tmp_path):
    assert (
        main(["draft", "train", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "o")])
        == 2
    )
    assert "no meta.json" in capsys.readouterr().err
    assert main(["draft", "data", "--n", "0", "--out", str(tmp_path / "d")]) == 2
    assert "n must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_train_tiny_preset_end_to_end(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path / "home"))
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--steps", "1", "--out", str(out)]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"val_accuracy"' in lines[0] and '"gen"' in lines[1]
    assert main(["train", "--preset", "tiny", "--set", "loss.bogus=1"]) == 2
    assert "unknown config key loss.bogus" in capsys.readouterr().err


# ------------------------------------------------ clear errors instead of tracebacks


@pytest.fixture
def tiny_home(tmp_path_factory, monkeypatch):
    """SPECROLL_HOME shared by these tests, so `--model tiny` is built once (no download)."""
    home = tmp_path_factory.getbasetemp() / "specroll-home"
    monkeypatch.setenv("SPECROLL_HOME", str(home))
    return home


@pytest.mark.parametrize(
    "record,needle",
    [
        ({"prompt": ["a", "b"]}, "chat messages"),
        ({"prompt": {"text": "hi"}}, "'prompt' must be a string"),
        ({"prompt": 7}, "'prompt' must be a string"),
        ({"prompt": ""}, "'prompt' is empty"),
        ({"prompt": "hi", "answer": [1]}, "'answer' must be a string or a number"),
    ],
)
def test_bad_prompt_records_in_train_and_generate(capsys, tmp_path, tiny_home, record, needle):
    import json

    f = tmp_path / "tasks.jsonl"
    f.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + json.dumps(record) + "\n")
    fails_clearly(capsys, ["generate", "--model", "tiny", "--prompts", str(f)], "tasks.jsonl:2")
    argv = ["train", "--preset", "tiny", "--set", f"data.train={f}", "--out", str(tmp_path)]
    fails_clearly(capsys, argv, "tasks.jsonl:2", needle)


def test_malformed_preset_names_the_file_and_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy:\n  model: tiny\nloss: [1\n")
    fails_clearly(capsys, ["train", "--preset", str(bad)], "bad.yaml", "line ")
    bad.write_text("policy: tiny\n")
    fails_clearly(capsys, ["train", "--preset", str(bad)], "bad.yaml", "'policy'", "mapping")


def test_missing_drafter_paths_name_path_and_expectation(capsys, tmp_path, tiny_home):
    gone = str(tmp_path / "nonexistent")
    for kind in ("eagle3", "mtp"):
        argv = ["generate", "--model", "tiny", "--drafter", f"{kind}:{gone}", "--prompt", "hi"]
        fails_clearly(capsys, argv, gone, "config.json")
    argv = ["draft", "eval", "--policy", "tiny", "--draft", gone]
    fails_clearly(capsys, argv, gone, "config.json")
    argv = ["generate", "--model", "tiny", "--drafter", "medusa:x", "--prompt", "hi"]
    fails_clearly(capsys, argv, "medusa", "ngram", "eagle3:PATH", "mtp:PATH")


def test_errors_reach_a_non_terminal_stderr_in_one_line(tmp_path):
    """The user's case: a subprocess with stderr piped (no terminal), a long path."""
    import os
    import subprocess
    import sys

    gone = tmp_path / ("d" * 60) / "nonexistent"
    run = subprocess.run(
        [sys.executable, "-m", "specroll.cli", "draft", "eval", "--policy", "tiny"]
        + ["--draft", str(gone)],
        capture_output=True,
        text=True,
        env={**os.environ, "SPECROLL_HOME": str(tmp_path / "home")},
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    last = run.stderr.splitlines()[-1]
    assert last.startswith("error: ") and str(gone) in last, run.stderr


# ------------------------------------------------ generate: results on stdout


def test_generate_writes_completions_to_stdout(capsys, tmp_path, tiny_home):
    argv = ["generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "40"]
    assert main([*argv, "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    assert main([*argv, "--seed", "3", "--out", str(tmp_path / "s.jsonl")]) == 0
    import json

    completion = json.loads((tmp_path / "s.jsonl").read_text())["completion"]
    assert completion.strip() and completion in out  # stdout holds the text, unwrapped
    assert "hi" in out  # the per-prompt header
    assert "tok/s" in err and "tok/s" not in out  # diagnostics on stderr
    out, err = capsys.readouterr()
    assert out == "" and "wrote 1 samples" in err


# ------------------------------------------------ speculation that was mostly off


def test_generate_says_when_speculation_was_mostly_off(capsys, tiny_home):
    argv = ["generate", "--model", "tiny", "--drafter", "ngram", "--k", "3"]
    argv += ["--max-new-tokens", "12", "--temperature", "0"]
    assert main(argv) == 0  # 8 builtin prompts > --spec-max-batch 4
    err = capsys.readouterr().err
    assert "speculation was off for" in err and "--spec-max-batch=4" in err, err
    assert main([*argv, "--batch", "4"]) == 0
    assert "speculation was off" not in capsys.readouterr().err


def test_train_device_flags_name_the_field_and_the_values(capsys, tmp_path):
    out = str(tmp_path / "run")
    assert main(["train", "--preset", "tiny", "--out", out, "--device", "gpu"]) == 2
    err = capsys.readouterr().err
    assert "rollout.device" in err and "cuda:N" in err
    # a --set overrides the shorthand on its side only: the error names the learner's
    bad = ["--device", "cpu", "--set", "learner.device=tpu"]
    assert main(["train", "--preset", "tiny", "--out", out, *bad]) == 2
    assert "learner.device" in capsys.readouterr().err
    if not __import__("torch").cuda.is_available():
        assert main(["train", "--preset", "tiny", "--out", out, "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err
