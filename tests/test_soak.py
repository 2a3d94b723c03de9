"""The hostile-use soak (issues 30 and 44), a few cases of `benchmarks/soak_hostile.py`:
random valid and invalid settings, SIGINT/SIGTERM at random moments then `--resume`,
damaged checkpoints, the user's files in the output directory; and files and values from
elsewhere (rewards, data files, YAML, untrusted checkpoints, changed inputs, export, a
full disk, generate, loggers). Slow (a few minutes): run with `-m slow`; the 50-case soaks
are the benchmark itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).parent.parent / "benchmarks" / "soak_hostile.py"


@pytest.mark.slow
def test_a_short_soak_finds_no_traceback_lost_step_or_touched_file(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--cases", "5", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["by_kind"] == {k: 1 for k in ("valid", "invalid", "signal", "damage", "foreign")}
    assert result["tracebacks"] == 0, proc.stderr
    assert result["lost_completed_steps"] == 0, proc.stderr
    assert result["user_files_touched"] == 0, proc.stderr
    assert result["hangs"] == 0 and result["unexpected"] == 0, proc.stderr


@pytest.mark.slow
def test_a_short_soak_of_files_from_elsewhere_runs_no_code_and_leaves_nothing_behind():
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--cases", "9", "--seed", "1", "--areas", "inputs"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["by_kind"].values()) == {1}, result["by_kind"]
    for key in ("tracebacks", "lost_completed_steps", "user_files_touched", "code_executions"):
        assert result[key] == 0, (key, proc.stderr)
    assert result["orphans"] == 0 and result["hangs"] == 0, proc.stderr
    assert result["unexpected"] == 0, proc.stderr
