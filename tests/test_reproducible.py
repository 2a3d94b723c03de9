"""A refactor must not change training: the tiny preset's metrics (3 seeds x 10 steps,
speculative and plain rollouts) are compared, every figure but the timings, with the
ones recorded in tests/fixtures/tiny_metrics.json.

Record them again (only when a change is *meant* to change training, and say so in the
commit) with `python tests/test_reproducible.py --record`, from the repository root."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_metrics.json"
SEEDS = (0, 1, 2)
STEPS = 10
MODES = {"spec": "true", "ar": "false"}
TIMINGS = (
    "time",
    "step_s",
    "gen_tok_s",
    "gen_busy_s",
    "exposed_gen_s",
    "shadow_ar_gen_s",
    "gen_speedup",
    "gen_rate_speedup",
)


def deterministic(row: dict) -> dict:
    """A metrics.jsonl row without its wall-clock figures."""
    return {k: v for k, v in row.items() if k not in TIMINGS}


def run(out: Path, seed: int, speculative: str) -> list[dict]:
    """metrics.jsonl of `specroll train --preset tiny` with this seed and rollout mode."""
    cmd = [
        sys.executable,
        "-m",
        "specroll.cli",
        "train",
        "--preset",
        "tiny",
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--set",
        f"pipeline.seed={seed}",
        "--set",
        f"rollout.speculative={speculative}",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [deterministic(json.loads(x)) for x in lines]


def record_all(root: Path) -> dict[str, list[dict]]:
    return {
        f"{mode}-seed{seed}": run(root / f"{mode}-{seed}", seed, flag)
        for mode, flag in MODES.items()
        for seed in SEEDS
    }


@pytest.mark.slow
def test_tiny_preset_metrics_are_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path / "home"))
    want = json.loads(FIXTURE.read_text())
    got = record_all(tmp_path)
    for name in want:
        assert got[name] == want[name], f"{name}: training changed"


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        os.environ["SPECROLL_HOME"] = str(Path(d) / "home")
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(record_all(Path(d)), indent=None) + "\n")
    print(f"wrote {FIXTURE}")
