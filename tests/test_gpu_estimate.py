"""A run's report says what its measured acceptance would buy on a GPU: the simulator fed
with the run's acceptance and response lengths, labelled simulated wherever it appears."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from specroll.rl.config import build_config  # noqa: E402
from specroll.rl.run.report import write_report  # noqa: E402
from specroll.sim.catalogue import MODELS  # noqa: E402
from specroll.sim.run_on_gpu import simulate_on_gpu  # noqa: E402

LENGTHS = [20, 50, 128, 7, 90, 128, 3, 60] * 8
SMOL = MODELS["smollm2-135m"]


def _step(step: int, **extra) -> dict:
    """A metrics.jsonl step line with what the estimate reads (and the report needs)."""
    t = {"gen": 4.0, "reward": 0.1, "logprob": 1.0, "train": 3.0, "prepare": 0.1}
    m = {
        "step": step,
        "time": t,
        "step_s": 8.2,
        "reward": 0.25,
        "acceptance_length": None,
        "per_position": None,
        "depth_hist": [130],
        "gen_tokens": 1600,
        "groups": 8,
        "groups_kept": 4,
        "response_lengths": LENGTHS,
    }
    return {**m, **extra}


def _run(alpha: float) -> list[dict]:
    """Four steps whose online draft accepts each of its 3 positions with `alpha`."""
    return [_step(s, draft_accept=[alpha] * 3) for s in range(1, 5)]


def test_higher_acceptance_simulates_a_larger_speedup_and_deeper_drafts():
    low, mid, high = (simulate_on_gpu(_run(a), SMOL) for a in (0.3, 0.6, 0.9))
    assert 1.0 < low.gen_speedup < mid.gen_speedup < high.gen_speedup
    assert low.k <= mid.k <= high.k and high.k == 3  # no deeper than the positions known
    assert high.acceptance.source == "draft_accept"
    assert high.acceptance.steps == (3, 4)  # the second half of the run
    assert high.acceptance.tokens == 2 * 1600 * 4 // 8  # the kept groups' tokens, about
    assert simulate_on_gpu(_run(0.9), SMOL, gpu="h200").gpu == "h200"


def test_the_engines_acceptance_is_used_only_when_it_rests_on_enough_drafted_tokens():
    few = [_step(1, per_position=[0.9, 0.8], depth_hist=[120, 0, 5], draft_accept=[0.3] * 3)]
    est = simulate_on_gpu(few, SMOL)
    assert est.acceptance.source == "draft_accept"
    many = [_step(s, per_position=[0.9, 0.72], depth_hist=[10, 0, 600]) for s in (1, 2)]
    est = simulate_on_gpu(many, SMOL)
    assert est.acceptance.source == "engine" and est.acceptance.tokens == 1200
    assert est.acceptance.alphas == pytest.approx(
        [0.9, 0.8]
    )  # conditional, from the cumulative rates
    assert ">= 1200 drafted tokens" in est.line() and "engine" in est.line()
    assert est.gen_speedup > 1.0


def test_without_any_acceptance_there_is_no_estimate_and_no_line(tmp_path):
    rows = [_step(s) for s in (1, 2)]  # speculation off: nothing drafted, no draft trained
    assert simulate_on_gpu(rows, SMOL) is None
    write_report(tmp_path, rows, build_config("default"))
    text = (tmp_path / "report.md").read_text()
    assert "simulated" not in text


def test_the_report_shows_the_estimate_beside_gen_speedup_labelled_simulated(tmp_path):
    rows = _run(0.8)
    rows[-1].update(shadow_ar_gen_s=4.2, gen_speedup=1.05)  # measured on this machine
    write_report(tmp_path, rows, build_config("default"))  # SmolLM2-135M, batch 32
    text = (tmp_path / "report.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| ")]
    names = [line.split(" | ")[0][2:] for line in table]
    at = names.index("gen_speedup")
    assert names[at + 1 : at + 3] == ["simulated_gen_speedup", "simulated_gen_basis"]
    assert "one H100" in table[at + 2] and "simulated, not measured" in table[at + 2]
    line = next(x for x in text.splitlines() if x.startswith("- simulated on one H100"))
    assert "source: online draft's draft_accept, steps 3-4" in line
    assert "generation x" in line and "(k=" in line and "simulated, not measured" in line
