"""A run treated as a careless or unlucky user treats it (issue 30): its directory never
loses the user's files or a completed step, damage falls back to the last good
checkpoint, signals stop it cleanly and resuming repeats the uninterrupted run, and a
non-finite update stops training with the last good weights kept."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specroll.cli import main
from specroll.rl.run import checkpoint
from specroll.rl.run.report import step_line, summarise
from specroll.rl.run.task import StepRewards
from tests.conftest import err_text, train_tiny


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _steps(out: Path) -> list[int]:
    return [r["step"] for r in _rows(out)]


TIMING = ("time", "step_s", "gen_tok_s", "gen_busy_s", "exposed_gen_s")


def _comparable(rows: list[dict]) -> list[dict]:
    """Metrics lines without wall-clock figures (adaptive-free tiny preset: the rest is
    deterministic, logprob checks included)."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 4-step tiny run (checkpoints at steps 2 and 4), copied by each test."""
    root = tmp_path_factory.mktemp("finished")
    old = os.environ.get("SPECROLL_HOME")
    os.environ["SPECROLL_HOME"] = str(root / "home")
    try:
        assert train_tiny(root / "run", "--steps", "4") == 0
    finally:
        if old is None:
            del os.environ["SPECROLL_HOME"]
        else:
            os.environ["SPECROLL_HOME"] = old
    return root / "run"


def _copy(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


# ---------------------------------------------------------------- the user's files


def test_a_new_run_never_deletes_or_replaces_files_it_did_not_write(home, tmp_path, capsys):
    d = tmp_path / "d"
    (d / "policy").mkdir(parents=True)
    (d / "policy" / "notes.txt").write_text("n\n")
    (d / "report.md").write_text("r\n")
    assert train_tiny(d, "--steps", "1") == 2
    err = err_text(capsys)
    assert "report.md" in err and "--overwrite" in err
    # --overwrite replaces what a run writes, never the user's notes
    assert train_tiny(d, "--steps", "1", "--overwrite") == 2
    assert "notes.txt" in err_text(capsys)
    assert (d / "policy" / "notes.txt").read_text() == "n\n"
    assert (d / "report.md").read_text() == "r\n"
    (d / "policy" / "notes.txt").unlink()
    assert train_tiny(d, "--steps", "1", "--overwrite") == 0
    assert (d / "report.md").read_text() != "r\n"


def test_a_run_holds_its_directory_against_another_process(home, tmp_path, capsys):
    out = tmp_path / "same"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from specroll.outputs import DirLock; "
            f"DirLock({str(out)!r}).acquire(); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert train_tiny(out, "--steps", "1") == 2
        err = err_text(capsys)
        assert "in use" in err and f"pid {holder.pid}" in err
        assert not (out / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert train_tiny(out, "--steps", "1") == 0  # the lock dies with its process


# ---------------------------------------------------------------- damaged checkpoints


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


DAMAGE = {
    "truncated state.pt": lambda ck: _truncate(ck / "state.pt"),
    "empty state.pt": lambda ck: (ck / "state.pt").write_bytes(b""),
    "empty meta.json": lambda ck: (ck / "meta.json").write_text(""),
    "missing meta.json": lambda ck: (ck / "meta.json").unlink(),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_found_and_the_previous_checkpoint_chosen(finished, tmp_path, kind):
    root = tmp_path / "checkpoints"
    shutil.copytree(finished / "checkpoints", root)
    assert checkpoint.newest_intact(root) == (root / "step-000004", [])
    DAMAGE[kind](root / "step-000004")
    path, skipped = checkpoint.newest_intact(root)
    assert path == root / "step-000002"
    assert len(skipped) == 1 and "skipped the damaged checkpoint step-000004" in skipped[0]
    assert "meta.json" in skipped[0] or "state.pt" in skipped[0]  # names the file


@pytest.mark.parametrize("kind", ["truncated state.pt", "missing meta.json"])
def test_resume_skips_a_damaged_checkpoint_and_says_why(home, finished, tmp_path, capsys, kind):
    out = _copy(finished, tmp_path)
    DAMAGE[kind](out / "checkpoints" / "step-000004")
    capsys.readouterr()
    assert train_tiny(out, "--resume", "--steps", "5") == 0
    err = err_text(capsys)
    assert "skipped the damaged checkpoint step-000004" in err
    assert "resumed from" in err and "(step 2)" in err
    assert _steps(out) == [0, 1, 2, 3, 4, 5]
    assert _comparable(_rows(out))[:5] == _comparable(_rows(finished))  # steps 3, 4 redone


def test_resume_with_every_checkpoint_damaged_names_each(home, finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    for ck in (out / "checkpoints").iterdir():
        _truncate(ck / "state.pt")
    assert train_tiny(out, "--resume", "--steps", "5") == 2
    err = err_text(capsys)
    assert "no intact checkpoint" in err and "step-000004" in err and "step-000002" in err


def test_a_checkpoint_that_cannot_be_written_keeps_the_previous_one(tmp_path):
    root = tmp_path / "checkpoints"
    state = {"config": {}, "w": [1, 2]}
    checkpoint.save(root, 1, state)
    (root / ".tmp-step-000007").mkdir()  # left by a process killed mid-write

    def disk_full(directory: Path) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(checkpoint.CheckpointError, match="No space left.*step-000001.*kept"):
        checkpoint.save(root, 2, state, write=disk_full)
    assert sorted(p.name for p in root.iterdir()) == ["step-000001"]
    assert checkpoint.damage(root / "step-000001") is None


# ---------------------------------------------------------------- the directory's path


def test_resume_accepts_any_path_to_the_same_directory(home, finished, tmp_path, monkeypatch):
    from specroll.rl.config import build_config
    from specroll.rl.run import rundir

    out = _copy(finished, tmp_path)
    monkeypatch.chdir(tmp_path)
    for path in (f"{out}/", "run", "./run/"):
        cfg = build_config("tiny", [f"pipeline.out_dir={path}", "pipeline.steps=5"])
        plan = rundir.check(path, cfg.to_dict(), 5, resume=True, overwrite=False)
        assert (plan.action, plan.step) == ("resume", 4)
    moved = tmp_path / "moved"
    out.rename(moved)
    assert train_tiny(moved, "--resume", "--steps", "5") == 0
    assert _steps(moved) == [0, 1, 2, 3, 4, 5]


# ---------------------------------------------------------------- signals and the end


def _stop_with(sig: int, at: int, times: int = 1):
    def on_step(m: dict) -> None:
        if m["step"] == at:
            for _ in range(times):
                os.kill(os.getpid(), sig)

    return on_step


def _trainer(out: Path, *overrides: str):
    from specroll.cli.common import load_dir, resolve_model_dir
    from specroll.rl.config import build_config
    from specroll.rl.run.draft import build_draft
    from specroll.rl.run.trainer import Trainer

    cfg = build_config("tiny", [f"pipeline.out_dir={out}", *overrides])
    path = resolve_model_dir(cfg.policy.model)
    policy, tok = load_dir(path)
    return Trainer(cfg, policy, tok, build_draft(cfg, policy, tok, path), log=lambda s: None)


def test_sigterm_saves_and_the_resumed_run_repeats_the_uninterrupted_one(home, finished, tmp_path):
    out = tmp_path / "run"
    t = _trainer(out, "pipeline.steps=4")
    with pytest.raises(KeyboardInterrupt) as stop:
        t.run(on_step=_stop_with(signal.SIGTERM, at=3))
    assert stop.value.signum == signal.SIGTERM and "step-000003" in str(stop.value)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    _trainer(out, "pipeline.steps=4").run(resume=True)
    # every key, the first resumed step's logprob checks included
    assert _comparable(_rows(out)) == _comparable(_rows(finished))


def _even_scores(self, problems, results, samples):
    """`Task.score` with `_even_answers` (every reward of a step goes through it)."""
    return StepRewards(_even_answers(self, problems, results, samples), {})


def _even_answers(self, problems, results, samples):
    """Rewards that make a group informative iff its answer is even (the tiny policy's own
    are almost all 0, and refill would find nothing to keep)."""
    out = torch.zeros(len(problems), samples)
    for i, prob in enumerate(problems):
        out[i, 0] = float(int(prob.answer) % 2 == 0)
    return out


ISSUE_31 = (
    "pipeline.steps=3",
    "pipeline.checkpoint_every=1",
    "data.val_size=0",
    "data.prompts_per_step=4",
    "data.group_size=2",
    "rollout.max_new_tokens=6",
    "rollout.top_p=0.9",
    "rollout.speculative=false",  # (speculation's resume: the test above)
    "loss.drop_uniform_groups=true",
    "loss.max_refill_rounds=2",
    "loss.aggregation=seq_mean_token_sum_norm",
    "policy.warmup_steps=1",
    "policy.lr_schedule=cosine",
    "policy.min_lr_ratio=0.1",
)
"""Issue 31's settings whose state a resume must carry: refill rounds (their prompts and
seeds), the learning-rate schedule, top-p rollouts, Dr. GRPO's aggregation."""


def test_a_resumed_run_with_refill_and_a_schedule_repeats_the_uninterrupted_one(
    home, tmp_path, monkeypatch
):
    from specroll.rl.run.task import Task

    monkeypatch.setattr(Task, "score", _even_scores)
    whole = tmp_path / "whole"
    _trainer(whole, *ISSUE_31).run()
    rows = _rows(whole)
    # warmup 1 step, then cosine from 1 to 0.1 of lr=1e-3 over the 2 steps left
    assert [r["lr"] for r in rows] == pytest.approx([1e-3, 1e-3, 0.55e-3])
    assert any(r.get("refill_rounds") for r in rows)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        _trainer(out, *ISSUE_31).run(on_step=_stop_with(signal.SIGTERM, at=1))
    _trainer(out, *ISSUE_31).run(resume=True)
    assert _comparable(_rows(out)) == _comparable(rows)


def test_a_run_stopped_after_its_first_validation_logs_it_once(
    home, finished, tmp_path, monkeypatch
):
    """Found by the soak: SIGTERM during step 1 saved step 0 and the resumed run
    validated again, logging step 0 twice."""
    out = tmp_path / "run"
    t = _trainer(out, "pipeline.steps=4")
    validate = t.validate

    def then_stop() -> dict:
        accuracy = validate()
        os.kill(os.getpid(), signal.SIGTERM)
        return accuracy

    monkeypatch.setattr(t, "validate", then_stop)
    with pytest.raises(KeyboardInterrupt, match="step-000000"):
        t.run()
    _trainer(out, "pipeline.steps=4").run(resume=True)
    assert _comparable(_rows(out)) == _comparable(_rows(finished))


def test_a_second_signal_stops_at_once_and_says_there_is_no_new_checkpoint(home, tmp_path):
    t = _trainer(tmp_path / "run", "pipeline.steps=4")
    with pytest.raises(KeyboardInterrupt, match="second Ctrl-C.*without a checkpoint.*step-000002"):
        t.run(on_step=_stop_with(signal.SIGINT, at=3, times=2))


def test_sigterm_from_outside_exits_143_saying_what_was_saved(home, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "SPECROLL_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "specroll.cli", "train", "--preset", "tiny", "--steps", "40"]
    proc = subprocess.Popen([*cmd, "--out", str(out)], env=env, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # wait for a completed step
        if "step 1/40" in line:
            break
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    assert "SIGTERM: finishing the current stage" in err and "interrupted: saved" in err
    done = max(_steps(out))
    assert checkpoint.latest(out / "checkpoints").name == f"step-{done:06d}"  # none lost


def test_a_run_stopped_after_its_last_checkpoint_is_finished_by_resume(home, finished, tmp_path):
    out = _copy(finished, tmp_path)
    (out / "report.md").unlink()
    shutil.rmtree(out / "policy")
    assert train_tiny(out, "--resume") == 0
    assert (out / "report.md").is_file()
    assert (
        load_file(out / "policy" / "model.safetensors").keys()
        == load_file(finished / "policy" / "model.safetensors").keys()
    )
    assert _rows(out) == _rows(finished)  # no step redone


def test_resume_with_fewer_steps_than_planned_says_how_far_the_run_got(
    home, finished, tmp_path, capsys
):
    out = _copy(finished, tmp_path)
    meta = out / "checkpoints" / "step-000004" / "meta.json"
    m = json.loads(meta.read_text())
    m["config"]["pipeline"]["steps"] = 12  # as if stopped at step 4 of 12
    meta.write_text(json.dumps(m))
    capsys.readouterr()
    assert train_tiny(out, "--resume", "--steps", "3") == 0
    err = err_text(capsys)
    assert "done 4 of its 12 steps" in err and "--steps 12" in err


# ---------------------------------------------------------------- non-finite numbers


@pytest.mark.parametrize("setting", ["policy.lr=inf", "loss.clip_low=nan", "draft.lr=-inf"])
def test_non_finite_settings_are_refused_up_front(home, tmp_path, capsys, setting):
    assert train_tiny(tmp_path / "x", "--set", setting) == 2
    assert "must be a finite number" in err_text(capsys)
    assert not (tmp_path / "x").exists()


def test_a_non_finite_update_stops_training_and_keeps_the_last_good_weights(
    home, tmp_path, capsys, monkeypatch
):
    """A NaN reaching the loss at step 2 (here through the advantages, as a reward of NaN
    would): the update is not applied, the step-1 weights are saved, nothing NaN is
    exported, and the command fails naming what went non-finite."""
    from specroll.rl.algo import advantages

    real, calls = advantages.step_advantages, []

    def nan_at_step_2(*args, **kwargs):
        adv, keep = real(*args, **kwargs)
        calls.append(1)
        return (adv * float("nan") if len(calls) == 2 else adv), keep

    monkeypatch.setattr(advantages, "step_advantages", nan_at_step_2)
    out = tmp_path / "run"
    assert train_tiny(out, "--steps", "4") == 1
    err = err_text(capsys)
    assert "error: step 2: policy_loss nan" in err and "the update was not applied" in err
    assert "weights of step 1 are saved" in err
    assert not (out / "policy" / "model.safetensors").exists()  # nothing NaN exported
    assert _steps(out) == [0, 1]
    ck = out / "checkpoints" / "step-000001"
    assert checkpoint.damage(ck) is None
    state = checkpoint.load(ck)
    assert all(t.isfinite().all() for t in state["policy"].values() if t.is_floating_point())


# ---------------------------------------------------------------- what the run reports


def test_the_step_line_and_report_say_how_much_speculation_happened():
    m = {
        "step": 3,
        "reward": 0.1,
        "accuracy": 0.1,
        "response_len_mean": 20,
        "acceptance_length": 2.0,
        "depth_hist": [130, 0, 0, 1],
        "time": {"gen": 1.0, "logprob": 0.1, "train": 0.2},
        "step_s": 1.3,
        "gen_tok_s": 100,
    }
    assert "AL 2.00 in 1/131 iters" in step_line(m, 10)
    rows = [
        {**m, "step": 1, "acceptance_length": 2.0, "depth_hist": [130, 0, 0, 1]},
        {**m, "step": 2, "acceptance_length": 1.2, "depth_hist": [10, 0, 0, 99]},
    ]
    s = summarise(rows)
    assert s["speculated_share"] == round(100 / 240, 4)
    assert s["acceptance_length_mean"] == pytest.approx((2.0 * 1 + 1.2 * 99) / 100, abs=1e-3)


# ---------------------------------------------------------------- presets


@pytest.mark.parametrize(
    "text, needle",
    [
        ("", "is empty"),
        ("rollout:\n  k: 2\nrollout:\n  k: 3\n", "rollout"),
        (b"\x00\x01\xffPK\x03\x04", "not a text"),
    ],
)
def test_a_preset_file_that_says_nothing_clear_is_refused(tmp_path, capsys, text, needle):
    p = tmp_path / "my.yaml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["train", "--preset", str(p), "--out", str(tmp_path / "o")]) == 2
    err = err_text(capsys)
    assert str(p) in err and needle in err
    assert not (tmp_path / "o").exists()
