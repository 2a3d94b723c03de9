"""What the README promises of `--resume` and of a run's seed, on the default preset's
rollout settings (issue 58): adaptive depth with a draft that samples its drafts.

With `rollout.depth: adaptive` the depth of each iteration follows measured times, and
another depth draws other (equally exact) tokens, so neither a resumed run nor a second
run with the same seed repeats the first's tokens. What a resume does repeat under every
setting: the steps it kept, the prompts and seeds of every step, the learning rate. With
`rollout.depth: fixed` it repeats everything but the timings
(`test_hostile_run.py::test_sigterm_saves_and_the_resumed_run_repeats_the_uninterrupted_one`).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.test_hostile_run import _rows, _stop_with, _trainer

DEFAULT_ROLLOUT = (
    "pipeline.steps=3",
    "rollout.depth=adaptive",  # the default preset's, with its drafter (eagle3) and T = 1
    "rollout.temperature=1.0",
    "log.samples=16",  # every rollout of a step: its prompt and answer
)


def _samples(out: Path) -> list[tuple]:
    """(step, index, uid, prompt, answer) of every sample line."""
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    return [(r["step"], r["index"], r["uid"], r["prompt"], r["answer"]) for r in rows]


def test_a_resume_under_adaptive_depth_repeats_what_the_readme_says_it_repeats(home, tmp_path):
    whole = tmp_path / "whole"
    _trainer(whole, *DEFAULT_ROLLOUT).run()
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        _trainer(out, *DEFAULT_ROLLOUT).run(on_step=_stop_with(signal.SIGTERM, at=1))
    kept = _rows(out)
    _trainer(out, *DEFAULT_ROLLOUT).run(resume=True)
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[: len(kept)] == kept  # the steps before the checkpoint, as written
    # the prompts (and their order and answers) of every step, and the learning rate
    assert _samples(out) == _samples(whole)
    assert [r.get("lr") for r in rows] == [r.get("lr") for r in _rows(whole)]
    # the depths came from measured times: the adaptive controller drafted
    assert any(r.get("acceptance_length") for r in rows[1:])
