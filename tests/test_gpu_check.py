"""`benchmarks/gpu_check.py --device cpu`: the dry run of the one-command GPU check.

The GPU slot is one call of a few minutes, so the script's every path but the GPU's own
(CUDA graphs replaying, torch.compile, the pytest subprocess) runs here on tiny shapes:
its last stdout line parses as JSON with a row per measured configuration.
"""

from __future__ import annotations

import json

from benchmarks import gpu_check
from specroll.sim.measured import gpu_costs


def test_the_cpu_dry_run_reports_every_configuration(capsys):
    returned = gpu_check.main(["--device", "cpu"])
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert report == json.loads(json.dumps(returned))
    expected = {"config", "shapes", "copy_gb_s", "floors", "rows", "anchor", "gpu_tests"}
    expected |= {"targets", "targets_met", "skipped", "errors", "wall_s"}
    assert expected <= report.keys()
    assert report["device"] == "cpu" and report["errors"] == [] and report["skipped"] == []
    assert report["gpu_tests"] is None  # a dry run runs no GPU tests

    cfg, shapes = report["config"], gpu_check.SHAPES["cpu"]
    modes, batches = cfg["modes"], cfg["batches"]
    assert modes == ["plain", "chain1", "chain3", "tree4", "tree16", "rchain4", "rchain16"]
    assert batches == [1, 2]
    # a row per (shape, batch, mode, graphs): every mode of small and mid, big's split in two
    got = {(r["shape"], r["batch"], r["mode"], r["graphs"]) for r in report["rows"]}
    want = {
        (shapes[role][0], b, m, g)
        for role in ("small", "big", "mid")
        for b in batches
        for m in modes
        for g in (False, True)
    }
    assert got == want and len(report["rows"]) == len(want)
    assert len(lines) - 1 == len(report["rows"]) + len(report["anchor"])  # a progress line each
    for r in report["rows"]:  # (times: plumbing only; tiny CPU runs are noise, even < 0)
        assert isinstance(r["ms_per_iter"], float) and r["forwards"] > 0
        assert (r["graph_stats"]["graphs"] > 0) == r["graphs"]  # the CPU stand-in replayed
        assert ("vs_plain" if r["mode"] != "plain" else "vs_floor") in r
    plain = [r for r in report["rows"] if r["mode"] == "plain"]
    assert all(r["forwards"] == cfg["new_tokens"] - 1 for r in plain)  # prefill not counted

    anchor = {(r["shape"], r["batch"]): r for r in report["anchor"]}
    assert anchor.keys() == {(name, b) for name, _ in shapes.values() for b in batches}
    assert all(isinstance(r["ms_per_iter"], float) for r in anchor.values())
    assert report["floors"].keys() == {name for name, _ in shapes.values()}
    assert all(f["floor_ms"] > 0 for f in report["floors"].values())

    names = {t["name"] for t in report["targets"]}
    assert len(names) == 4  # tree16 at batch 32 is not measured in a dry run
    assert all(isinstance(t["met"], bool) for t in report["targets"])

    # the simulator's tree inputs come from these rows (benchmarks/sim_history.py --gpu-check)
    costs = gpu_costs(report, shapes["big"][0], graphs=True)
    assert costs["batches"] == batches and costs["tree_overhead"] > 0
    assert costs["tree_fixed_ms"] >= 0
