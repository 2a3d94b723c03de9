"""Logging a run: W&B (offline: no network), MLflow (a file store in the run directory) and
`samples.jsonl` — each step's metrics at that step, the config, N sample completions per
step chosen as a pure function of the step, and a resumed run that redoes steps past its
checkpoint without duplicating their samples. A logger whose package is missing fails
before any model is loaded, naming the extra to install."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import fails_clearly, train_tiny

STEPS = ("--steps", "2", "--set", "pipeline.checkpoint_every=1")
LOGGED = ("--set", "log.wandb=true", "--set", "log.mlflow=true", "--set", "log.samples=3")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step tiny run logged to W&B (offline) and MLflow, 3 samples a step, with
    checkpoints at steps 1 and 2."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    root = tmp_path_factory.mktemp("logging")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECROLL_HOME", str(root / "home"))
        mp.setenv("WANDB_MODE", "offline")
        out = root / "run"
        assert train_tiny(out, *STEPS, *LOGGED) == 0
        yield out


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def wandb_records(path):
    """The protobuf records of an offline run's `.wandb` file (W&B's log format: a 7-byte
    header, then LevelDB-style chunks of at most 32 KiB blocks, each with a 7-byte
    header: CRC, length, type = full / first / middle / last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        n, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def _wandb_history(out) -> tuple[dict, dict[int, dict]]:
    """(the run's config, {step: {key: value}}) read back from the offline run files."""
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    (log,) = run_dir.glob("run-*.wandb")
    config, history = {}, {}
    for r in wandb_records(log):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            config = {i.key: json.loads(i.value_json) for i in r.run.config.update}
            assert r.run.run_id == json.loads((out / "run.json").read_text())["run_id"]
            assert r.run.display_name == out.name and r.run.project == "specroll"
        elif kind == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            history.setdefault(row["_step"], {}).update(row)
    return config, history


def test_wandb_offline_run_holds_the_config_and_each_steps_metrics(run):
    config, history = _wandb_history(run)
    assert config["pipeline"]["steps"] == 2 and config["log"]["samples"] == 3
    metrics = _rows(run / "metrics.jsonl")
    assert sorted(history) == [m["step"] for m in metrics] == [0, 1, 2]
    for m in metrics:
        logged = history[m["step"]]
        if "reward" in m:
            assert logged["reward"] == pytest.approx(m["reward"])
            assert logged["time/gen"] == pytest.approx(m["time"]["gen"])
            assert logged["samples/nrows"] == 3  # the step's samples table
        assert logged.get("val_accuracy") == pytest.approx(m.get("val_accuracy"))


def test_mlflow_file_store_holds_each_steps_metrics_and_samples(run, tmp_path):
    import os

    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    exp = client.get_experiment_by_name("specroll")
    (r,) = client.search_runs([exp.experiment_id])
    assert r.info.run_name == run.name and r.data.params["log.samples"] == "3"
    history = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "reward")}
    rewards = {m["step"]: m["reward"] for m in _rows(run / "metrics.jsonl") if "reward" in m}
    assert history == pytest.approx(rewards)
    # components beside the total ('/' written '.': a file store cannot hold both)
    math = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "reward.math")}
    assert math == pytest.approx({s: m["reward/math"] for s, m in _by_step(run).items()})
    files = [f.path for f in client.list_artifacts(r.info.run_id, "samples")]
    assert files == [f"samples/step-{s:06d}.json" for s in (1, 2)]
    local = client.download_artifacts(r.info.run_id, files[1], str(tmp_path))
    logged = json.loads(Path(local).read_text())
    assert logged == [x for x in _rows(run / "samples.jsonl") if x["step"] == 2]


def _by_step(run: Path) -> dict[int, dict]:
    return {m["step"]: m for m in _rows(run / "metrics.jsonl") if "reward" in m}


def test_samples_are_a_pure_function_of_the_step(run):
    from specroll.rl.run.samples import pick

    rows = _rows(run / "samples.jsonl")
    assert [r["step"] for r in rows] == [1, 1, 1, 2, 2, 2]
    for step in (1, 2):
        # 4 prompts x 4 samples; the indices depend on the step alone
        assert [r["index"] for r in rows if r["step"] == step] == pick(step, 16, 3)
    assert pick(1, 16, 3) != pick(2, 16, 3) and pick(2, 16, 3) == pick(2, 16, 3)
    for r in rows:
        assert r["group"] == r["index"] // 4 and r["prompt"].startswith("What is")
        assert 1 <= r["length"] <= 24 and r["reward"] in (0.0, 1.0)
        assert len(r["completion"]) > 0 and r["policy_version"] == r["step"] - 1
        assert 0 <= r["accepted"] <= r["drafted"]  # this rollout's own draft counters
        assert r["finish_reason"] in ("stop", "length")


def test_resume_redoes_samples_past_the_checkpoint_without_duplicates(run, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_HOME", str(run.parent / "home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = (copy / "samples.jsonl").read_text()
    # the run as if killed after writing step 2's lines, before its checkpoint
    shutil.rmtree(copy / "checkpoints" / "step-000002")
    (copy / "report.md").unlink()
    assert train_tiny(copy, *STEPS, "--resume", *LOGGED) == 0
    assert (copy / "samples.jsonl").read_text() == before
    assert [m["step"] for m in _rows(copy / "metrics.jsonl")] == [0, 1, 2]


def test_a_missing_logger_package_fails_before_any_model_loads(home, tmp_path, capsys, monkeypatch):
    from specroll.rl.run import loggers

    monkeypatch.setitem(loggers.EXTRAS, "wandb", ("no_such_wandb_module", "wandb"))
    out = tmp_path / "x"
    argv = ["train", "--preset", "tiny", "--out", str(out), "--set", "log.wandb=true"]
    fails_clearly(capsys, argv, "log.wandb=true", "pip install 'specroll[wandb]'")
    assert not (tmp_path / "home" / "models").exists() and not out.exists()


def test_sample_rows_carry_reward_components_and_acceptance():
    """The hook a reward made of parts uses: components [P, G] by name, per row."""
    from types import SimpleNamespace

    import torch

    from specroll.rl.run.samples import pick, rows
    from specroll.spec.metrics import SpecStats
    from specroll.tasks.arithmetic import Problem

    problems = [Problem(f"q{i}", str(i), 1, f"u{i}") for i in range(3)]
    results = [
        SimpleNamespace(
            token_ids=[1] * (i + 1),
            finish_reason="stop",
            policy_version=4,
            spec=SpecStats(draft_tokens=2 * i, accepted_tokens=i),
        )
        for i in range(6)
    ]
    tok = SimpleNamespace(decode=lambda ids: "x" * len(ids))
    rewards = torch.arange(6.0).view(3, 2)
    parts = {"format": rewards / 10, "answer": rewards % 2}
    got = rows(5, 4, problems, results, rewards, tok, components=parts)
    assert [r["index"] for r in got] == pick(5, 6, 4)
    for r in got:
        i = r["index"]
        assert (r["group"], r["prompt"], r["answer"]) == (i // 2, f"q{i // 2}", str(i // 2))
        assert (r["reward"], r["length"], r["completion"]) == (float(i), i + 1, "x" * (i + 1))
        assert r["reward_components"] == {"format": i / 10, "answer": float(i % 2)}
        assert (r["drafted"], r["accepted"]) == (2 * i, i)
    plain = rows(5, 4, problems, results, rewards, tok, speculative=False)
    assert "drafted" not in plain[0] and "reward_components" not in plain[0]
    assert rows(5, 0, problems, results, rewards, tok) == []
