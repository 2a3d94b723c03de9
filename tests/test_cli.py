"""The command line fails fast and clearly on bad input (exit code 2, message names it)."""

from __future__ import annotations

import pytest

from specroll.cli import main
from specroll.drafters.build import build_drafter


def test_bad_sampling_argument_names_the_field(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_unknown_model_is_a_clear_error(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_unknown_drafter_lists_the_kinds(tiny_model):
    with pytest.raises(ValueError, match="ngram"):
        build_drafter("medusa", tiny_model)
    with pytest.raises(ValueError, match="eagle3:PATH"):
        build_drafter("eagle3", tiny_model)  # a path is required


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
