"""A run directory belongs to one run: a fresh run never overwrites another's work
unasked, `--resume` never loads another run's checkpoint, and both are decided before
any model is loaded or any file written."""

from __future__ import annotations

import json
import shutil

from safetensors.torch import load_file

from tests.conftest import err_text, train_tiny


def _steps(out) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_fresh_run_refuses_a_directory_holding_another_run(home, tmp_path, capsys):
    out = tmp_path / "x"
    assert train_tiny(out, "--steps", "6") == 0
    log = capsys.readouterr().err  # not a terminal: plain lines, one per step
    assert "loading " in log and "RL steps: started (total 6)" in log
    assert "step 6/6  reward " in log and '"time"' not in log
    before = (out / "metrics.jsonl").read_text()
    policy = load_file(out / "policy" / "model.safetensors")
    assert train_tiny(out) == 2
    err = err_text(capsys)
    assert "holds another run" in err and "--overwrite" in err and "--resume" in err
    assert (out / "metrics.jsonl").read_text() == before  # nothing touched
    assert (out / "checkpoints" / "step-000006").is_dir()
    # --overwrite starts over: the old run's checkpoints go, so none can be resumed later
    assert train_tiny(out, "--overwrite") == 0
    assert _steps(out) == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-000002",
        "step-000004",
    ]
    assert train_tiny(out, "--resume") == 0
    assert "finished at step 4" in err_text(capsys)
    after = load_file(out / "policy" / "model.safetensors")
    assert any(not after[k].equal(policy[k]) for k in policy)  # the 4-step run's weights
    assert _steps(out) == [0, 1, 2, 3, 4]


def test_resume_refuses_another_runs_checkpoint(home, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert train_tiny(a, "--steps", "3", "--set", "data.val_size=0") == 0
    assert train_tiny(b, "--steps", "1", "--set", "data.val_size=0") == 0
    shutil.copytree(a / "checkpoints" / "step-000003", b / "checkpoints" / "step-000003")
    assert train_tiny(b, "--resume", "--steps", "4", "--set", "data.val_size=0") == 2
    assert "belongs to run" in err_text(capsys)
    # a checkpoint of an older layout (no format in meta.json) is refused by name
    meta = b / "checkpoints" / "step-000003" / "meta.json"
    shutil.rmtree(b / "checkpoints" / "step-000001")
    old = json.loads(meta.read_text())
    old.pop("format")
    old["run_id"] = json.loads((b / "run.json").read_text())["run_id"]
    meta.write_text(json.dumps(old))
    assert train_tiny(b, "--resume", "--steps", "4", "--set", "data.val_size=0") == 2
    assert "checkpoint format 1, this specroll reads format 2" in err_text(capsys)


def test_resume_is_checked_before_any_work(home, tmp_path, capsys):
    out = tmp_path / "none"
    assert train_tiny(out, "--resume") == 2
    assert "no checkpoint" in err_text(capsys)
    assert not out.exists()  # no empty directory left behind
    assert not (tmp_path / "home" / "models").exists()  # no model was resolved
    assert train_tiny(out, "--resume", "--overwrite") == 2
    assert "contradict" in err_text(capsys)
    run = tmp_path / "run"
    assert train_tiny(run, "--steps", "2") == 0
    assert train_tiny(run, "--resume", "--steps", "3", "--set", "loss.clip_high=0.5") == 2
    assert "loss.clip_high=0.28" in err_text(capsys)
    # a longer run continues from the finished one's last checkpoint, and exports the
    # policy (with its tokenizer) and the draft again
    shutil.rmtree(run / "policy")
    shutil.rmtree(run / "draft")
    assert train_tiny(run, "--resume", "--steps", "3") == 0
    assert _steps(run) == [0, 1, 2, 3]
    assert (run / "policy" / "tokenizer.json").is_file()
    assert (run / "draft" / "config.json").is_file()


def test_zero_steps_is_not_ignored(home, tmp_path, capsys):
    assert train_tiny(tmp_path / "z", "--steps", "0") == 2
    assert "pipeline.steps must be >= 1, got 0" in err_text(capsys)
    assert not (tmp_path / "z").exists()
