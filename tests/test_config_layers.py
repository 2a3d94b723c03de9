"""A user's YAML layered over a preset (`--config`), and `specroll config`, which prints
the configuration a run would use with every field's documentation (issue 31, item 6)."""

from __future__ import annotations

import dataclasses

import pytest

from specroll.cli import main
from specroll.rl.config import SECTIONS, build_config
from tests.conftest import fails_clearly


def test_a_config_file_changes_only_what_it_says(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("rollout:\n  k: 2\ndata:\n  group_size: 4\n")
    tiny = build_config("tiny")
    cfg = build_config("tiny", configs=(str(mine),))
    assert (cfg.rollout.k, cfg.data.group_size) == (2, 4)
    # every other field keeps the preset's value, in the sections the file names too
    want = dataclasses.replace(
        tiny,
        rollout=dataclasses.replace(tiny.rollout, k=2),
        data=dataclasses.replace(tiny.data, group_size=4),
    )
    assert cfg == want
    # later files win, and --set wins over every file
    other = tmp_path / "other.yaml"
    other.write_text("rollout:\n  k: 1\n")
    cfg = build_config("tiny", ["rollout.k=3"], (str(mine), str(other)))
    assert (cfg.rollout.k, cfg.data.group_size) == (3, 4)


def test_the_printed_configuration_is_documented_and_reproduces_the_run(tmp_path, capsys):
    argv = ["--preset", "tiny", "--set", "rollout.k=2", "--steps", "3"]
    assert main(["config", *argv]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    for name, cls in SECTIONS.items():
        at = lines.index(f"{name}:")
        assert lines[at - 1].startswith("# ")  # the section's documentation
        for f in dataclasses.fields(cls):
            i = next(j for j, x in enumerate(lines) if j > at and x.startswith(f"  {f.name}: "))
            assert lines[i - 1].startswith("  # "), f"{name}.{f.name} has no documentation"
    saved = tmp_path / "resolved.yaml"
    saved.write_text(text)
    want = build_config("tiny", ["rollout.k=2", "pipeline.steps=3"])
    # a valid --config file: over any preset it gives back the same configuration
    assert build_config("default", configs=(str(saved),)) == want
    assert build_config("tiny", configs=(str(saved),)) == want


@pytest.mark.parametrize(
    "text, needles",
    [
        ("rollout:\n  kk: 3\n", ["unknown config key rollout.kk", "max_new_tokens"]),
        ("rolout:\n  k: 3\n", ["unknown config section 'rolout'"]),
        ("", ["is empty"]),
        ("rollout:\n  k: -1\n", ["rollout.k must be >= 0"]),
    ],
)
def test_a_bad_config_file_is_refused_naming_it(tmp_path, capsys, text, needles):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    last = fails_clearly(capsys, ["config", "--preset", "tiny", "--config", str(bad)], *needles)
    if "k: -1" not in text:  # a value out of range is named by its field
        assert str(bad) in last
    fails_clearly(capsys, ["config", "--config", str(tmp_path / "none.yaml")], "does not exist")


def test_train_help_points_to_the_config_command(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "specroll config" in out and "--config FILE" in out
