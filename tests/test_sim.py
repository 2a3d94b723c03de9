"""Simulator building blocks: catalogue shapes match the published ones; the analytic step
model shows the regimes speculation depends on."""

from __future__ import annotations

import pytest

from specroll.sim.catalogue import HARDWARE, MODELS, model_spec
from specroll.sim.stepmodel import AnalyticStep


@pytest.mark.parametrize(
    "name,total,active,kv_kib",
    [
        ("qwen3-8b", 8.2, 8.2, 144),
        ("qwen3-32b", 32.8, 32.8, 256),
        ("qwen3-30b-a3b", 30.5, 3.3, 96),
        ("qwen3-235b-a22b", 235.0, 22.1, 188),
    ],
)
def test_catalogue_matches_published_sizes(name, total, active, kv_kib):
    m = MODELS[name]
    assert m.params_total / 1e9 == pytest.approx(total, rel=0.02)
    assert m.params_active / 1e9 == pytest.approx(active, rel=0.02)
    assert m.kv_bytes_per_token // 1024 == kv_kib


def test_config_json_is_read(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"num_attention_heads": 9, "num_hidden_layers": 30, "hidden_size": 576, '
        '"num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152}'
    )
    assert model_spec(str(tmp_path)).kv_bytes_per_token == MODELS["smollm2-135m"].kv_bytes_per_token
    with pytest.raises(ValueError, match="qwen3-8b"):
        model_spec("gpt-9")


def test_verification_regimes():
    s = AnalyticStep(MODELS["qwen3-8b"], HARDWARE["h100"])

    def ratio(B, ctx, k=3):
        return s.target(B, k + 1, ctx) / s.target(B, 1, ctx)

    assert ratio(1, 1000) < 1.05  # memory bound: k+1 tokens cost about one
    assert ratio(512, 500) > 2.5  # compute bound: close to k+1
    assert ratio(256, 16000) < ratio(256, 1000)  # long context: shared KV read (MagicDec)
    moe = AnalyticStep(MODELS["qwen3-30b-a3b"], HARDWARE["h100"])
    assert moe.weights_read(1) < moe.weights_read(64) < moe.weights_read(4096)


def test_rollout_simulation_batch_shrinks_and_speculation_helps_the_tail():
    from specroll.engine.costmodel import CostModel
    from specroll.sim.rollout import Speculation, Workload, simulate_rollout

    sp = Speculation.from_acceptance_length(2.5, 3)
    assert sp.tau(3) == pytest.approx(2.5, rel=1e-6) and sp.tau(0) == 1.0
    # a memory-bound machine: verifying 4 tokens costs what 1 does, drafting is cheap
    cm = CostModel(fixed=0.01, per_token=1e-4, knee=64, draft_step=5e-4)
    w = Workload(prompts=4, samples=8, mean_len=200, sigma=1.0, max_len=1000)
    lengths = w.draw()
    ar = simulate_rollout(cm, lengths, 1, 16, w.prompt_len, Speculation())
    spec = simulate_rollout(cm, lengths, 1, 16, w.prompt_len, sp)
    assert ar["trace"][0][1] == 16 and ar["trace"][-1][1] < 16  # the batch shrinks
    assert 1.5 < ar["gen_s"] / spec["gen_s"] < 2.5
    adaptive = simulate_rollout(cm, lengths, 1, 16, w.prompt_len, Speculation(3, sp.alphas, True))
    assert adaptive["gen_s"] <= spec["gen_s"] * 1.001


def test_acceptance_lengths_at_several_k_are_all_reproduced():
    from specroll.sim.rollout import Speculation

    s = Speculation.from_acceptance_lengths({3: 2.77, 5: 3.23, 7: 3.48})
    assert [s.tau(k) for k in (3, 5, 7)] == pytest.approx([2.77, 3.23, 3.48], abs=1e-6)
    assert all(0 < a < 1 for a in s.alphas)
    with pytest.raises(ValueError, match="grow with k"):
        Speculation.from_acceptance_lengths({3: 2.5, 5: 2.4})


def test_advancing_runs_of_iterations_at_once_matches_the_token_loop():
    """The replica simulation times a run of identical iterations at its mid context; for
    a step model linear in the context that is exact, so it must equal one-by-one."""
    import numpy as np

    from specroll.engine.costmodel import CostModel
    from specroll.sim.rollout import Speculation, Workload, simulate_replica

    cm = CostModel(fixed=0.01, per_token=1e-4, knee=16, kv=1e-7, attn=2e-8, draft_step=1e-3)
    lengths = Workload(prompts=6, samples=8, mean_len=150, sigma=1.0, max_len=600).draw()
    for spec in (Speculation(), Speculation.from_acceptance_length(2.2, 3)):
        one = simulate_replica(cm, lengths, 12, 40, spec, max_run=1)
        run = simulate_replica(cm, lengths, 12, 40, spec, max_run=64)
        assert run["time"] == pytest.approx(one["time"], rel=1e-3)
        assert run["iterations"] == one["iterations"]
    assert np.array_equal(
        lengths, Workload(prompts=6, samples=8, mean_len=150, sigma=1.0, max_len=600).draw()
    )
    with pytest.raises(ValueError, match="workload.samples"):
        Workload(samples=0)


def test_async_lag_fills_the_tail_and_overlaps_the_learner():
    from specroll.sim.presets import paper_8b
    from specroll.sim.rlstep import Cluster, Pipeline

    sync = paper_8b("zero")
    sync.workload = replace_w(sync.workload, prompts=64)
    res = sync.run()
    st = res["stages_ar"]
    assert st["step"] == pytest.approx(st["gen"] + st["logprob"] + st["train"] + st["prepare"])
    lagged = paper_8b("zero")
    lagged.workload = sync.workload
    lagged.cluster = Cluster(gpus=32, gen_gpus=24)
    lagged.pipeline = Pipeline(lag=2)
    a = lagged.run()["stages_ar"]
    learner = a["logprob"] + a["train"] + a["prepare"]
    assert a["exposed_gen"] == pytest.approx(max(0.0, a["gen"] - learner))
    assert a["step"] == pytest.approx(learner + a["exposed_gen"])
    with pytest.raises(ValueError, match="gen_gpus"):
        Cluster(gpus=8, gen_gpus=8)


def replace_w(w, **kw):
    from dataclasses import replace

    return replace(w, **kw)


def test_paper_calibration_and_held_out_predictions():
    """The frozen calibration (benchmarks/sim_paper.py) reproduces what it was fitted on
    (RL-Zero AR generation) and predicts the held-out RL-Think k = 3 generation speed-up
    and both step speed-ups within 10%; k = 3 is the best fixed depth for both."""
    from specroll.sim.presets import PAPER, paper_8b

    for kind in ("zero", "think"):
        paper = PAPER[f"paper-8b-rl-{kind}"]
        runs = {k: paper_8b(kind, k=k).run() for k in (3, 5, 7)}
        assert runs[3]["stages_ar"]["gen"] == pytest.approx(paper["stages_ar"]["gen"], rel=0.02)
        assert runs[3]["gen_speedup"] == pytest.approx(paper["gen_speedup"][3], rel=0.10)
        assert runs[3]["step_speedup"] == pytest.approx(paper["step_speedup"], rel=0.10)
        assert runs[3]["gen_speedup"] > runs[5]["gen_speedup"] > runs[7]["gen_speedup"]


def test_simulate_cli_json_and_bad_input(capsys, tmp_path):
    import json

    from specroll.cli import main

    assert (
        main(["simulate", "--preset", "paper-8b-rl-think", "--json", "--plots", str(tmp_path)]) == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("gen_speedup", "step_speedup", "amdahl_bound", "stages_ar", "stages_spec"):
        assert key in out
    assert out["stages_spec"]["gen"] < out["stages_ar"]["gen"]
    assert (tmp_path / "heatmap.png").stat().st_size > 0 and (tmp_path / "trace.png").is_file()
    sweep = out["sweep"]
    assert len(sweep["gen_speedup"]) == len(sweep["k"])
    assert main(["simulate", "--preset", "nope"]) == 2
    assert "paper-8b-rl-zero" in capsys.readouterr().err
    assert main(["simulate", "--k", "3", "--acceptance-length", "4.5", "--no-sweep"]) == 2
    assert "acceptance-length" in capsys.readouterr().err
    (tmp_path / "lens.json").write_text("[100, 200, 4000]")
    args = ["simulate", "--lengths-from", str(tmp_path / "lens.json"), "--no-sweep", "--json"]
    assert main(args) == 0


@pytest.mark.parametrize("n", [1, 7, 15, 16, 17, 100, 8192])
def test_workload_draws_are_the_stream_they_were_calibrated_on(n):
    """`sim` dropped torch, not its numbers: the workload's normals are torch.randn's
    stream for the same seed (to an ulp), so the frozen paper calibration still holds."""
    import numpy as np
    import torch

    from specroll.sim.rollout import standard_normal

    for seed in (0, 3, 2**40 + 1):
        g = torch.Generator().manual_seed(seed)
        want = torch.randn(n, generator=g, dtype=torch.float64).numpy()
        assert np.allclose(standard_normal(n, seed), want, rtol=0, atol=1e-14)


def test_sim_imports_only_numpy_stdlib_and_itself():
    """`sim` is a numpy leaf: the `simulate` command (argparse, rich) and its plots
    (matplotlib) live in specroll/cli, so nothing under specroll/sim imports them."""
    import ast
    import sys
    from pathlib import Path

    import specroll.sim

    bad = []
    for path in sorted(Path(specroll.sim.__path__[0]).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ok = top in ("numpy", "__future__") or name.startswith("specroll.sim")
                if not ok and (top not in sys.stdlib_module_names or top == "argparse"):
                    bad.append(f"{path.name}:{node.lineno} imports {name}")
    assert not bad, "\n".join(bad)


def _tree_case():
    """A small memory-bound machine and workload for the measured-acceptance tests."""
    from specroll.engine.costmodel import CostModel
    from specroll.sim.rollout import Workload

    cm = CostModel(fixed=0.01, per_token=1e-4, knee=64, kv=1e-8, draft_step=5e-4)
    w = Workload(prompts=4, samples=8, mean_len=200, sigma=1.0, max_len=1000)
    return cm, w.draw(), w.prompt_len


def test_tau_table_matches_the_chain_it_tabulates_and_orders_costs():
    """A table equal to a chain's tau(k), costed as the chain (no tree_cost, or a tree
    cost of 1.0 with one draft forward per node), simulates the chain's time; more
    acceptance is faster; tree overhead and host drafting are slower."""
    from specroll.sim.rollout import Speculation, TreeCost, simulate_rollout

    cm, lengths, prompt = _tree_case()

    def gen(spec):
        return simulate_rollout(cm, lengths, 1, 16, prompt, spec)["gen_s"]

    chain = Speculation.from_acceptance_length(2.5, 3)
    table = {k: chain.tau(k) for k in range(4)}
    for adaptive in (False, True):
        want = gen(Speculation(3, chain.alphas, adaptive))
        for cost in (None, TreeCost(model_depth=3)):
            got = gen(Speculation(k=3, taus=table, tree_cost=cost, adaptive=adaptive))
            assert got == pytest.approx(want, rel=0.01)
    tree = {0: 1.0, 1: 1.3, 2: 1.45, 4: 1.6, 8: 1.8, 16: 1.95}
    base = gen(Speculation.measured(tree, TreeCost()))
    better = gen(Speculation.measured({n: 1 + 1.5 * (t - 1) for n, t in tree.items()}, TreeCost()))
    assert better < base < gen(Speculation())
    assert gen(Speculation.measured(tree, TreeCost(tree_overhead=1.4))) > base
    assert gen(Speculation.measured(tree, TreeCost(host_draft_s=2e-4))) > base


def test_tau_table_interpolates_and_adaptive_size_falls_back_to_plain():
    import math

    from specroll.sim.rollout import Speculation, TreeCost, simulate_rollout

    s = Speculation.measured({1: 1.3, 3: 1.5, 64: 2.1})
    assert s.taus[0] == 1.0 and s.tau(3) == 1.5 and s.tau(1000) == 2.1  # no extrapolation
    w = (math.log2(8) - math.log2(4)) / (math.log2(65) - math.log2(4))
    assert s.tau(7) == pytest.approx(1.5 + w * 0.6)
    assert s.depths(16) == [0, 1, 3, 64]
    cm, lengths, prompt = _tree_case()
    flat = Speculation.measured({n: 1.0 for n in (1, 4, 16)}, TreeCost())
    out = simulate_rollout(cm, lengths, 1, 16, prompt, flat)
    assert sum(out["depth_hist"][1:]) == 0  # every iteration plain
    plain = simulate_rollout(cm, lengths, 1, 16, prompt, Speculation())
    assert out["gen_s"] == pytest.approx(plain["gen_s"])


@pytest.mark.parametrize(
    "taus,match",
    [
        ({4: 1.6, 2: 1.4}, "speculation.taus sizes must increase"),
        ({2: 1.6, 4: 1.5}, "speculation.taus must not decrease"),
        ({1: 0.9}, r"speculation.taus values must be in \[1, n \+ 1\]"),
        ({1: 2.5}, "speculation.taus values"),
        ({}, "speculation.taus must hold"),
        ({0: 1.2, 1: 1.3}, r"speculation.taus\[0\]"),
        ({-1: 1.0}, "speculation.taus sizes"),
    ],
)
def test_bad_tau_tables_name_the_field(taus, match):
    from specroll.sim.rollout import Speculation

    with pytest.raises(ValueError, match=match):
        Speculation.measured(taus)


def test_bad_tree_costs_name_the_field():
    from specroll.sim.rollout import Speculation, TreeCost

    with pytest.raises(ValueError, match="tree_cost.tree_overhead"):
        TreeCost(tree_overhead=0.0)
    with pytest.raises(ValueError, match="tree_cost.host_draft_s"):
        TreeCost(host_draft_s=-1.0)
    with pytest.raises(ValueError, match="speculation.tree_cost needs speculation.taus"):
        Speculation(k=3, alphas=[0.8] * 3, tree_cost=TreeCost())


def test_project_onto_the_paper_8b_setting():
    """Chains and trees by name: acceptance 1 everywhere buys nothing; EAGLE-3 at the
    paper's acceptance lengths pays; host drafting time and tree overhead cost."""
    from specroll.sim.measured import project

    hist = {1: 1.5, 2: 1.8, 4: 2.2, 8: 2.6, 16: 2.9}
    acc = {
        "eagle3": {3: 3.32, 5: 4.35, 7: 5.06},
        "history": hist,
        "flat": {1: 1.0, 8: 1.0},
    }
    out = project(acc, tree_overhead=1.0, draft_ms={})
    assert out["flat"]["gen_speedup"] == pytest.approx(1.0)
    assert out["eagle3"]["gen_speedup"] > out["eagle3"]["step_speedup"] > 1.2
    assert 1.0 < out["history"]["gen_speedup"]
    assert set(out["history"]["sizes"]) <= {0, *hist}
    slow = project({"history": hist}, tree_overhead=1.5, draft_ms={"history": 0.5})
    assert slow["history"]["gen_speedup"] < out["history"]["gen_speedup"]


def test_gpu_check_rows_give_the_tree_inputs_of_a_projection():
    """What a tree of 4 nodes costs over a chain of 4 is the tree path's fixed time; a
    tree of 16 less that, over a chain of 16, its overhead; medians over batches."""
    from specroll.sim.measured import gpu_costs

    def row(mode, b, ms, graphs=True, shape="qwen3-8b"):
        return {"shape": shape, "batch": b, "mode": mode, "graphs": graphs, "ms_per_iter": ms}

    rows = [row("plain", 8, 9.0), row("tree4", 8, 12.0), row("rchain4", 8, 10.0)]
    rows += [row("tree16", 8, 17.0), row("rchain16", 8, 10.0)]
    rows += [row("tree4", 32, 14.0), row("rchain4", 32, 11.0), row("tree16", 32, 27.0)]
    rows += [row("rchain16", 32, 12.0), row("tree4", 64, 1.0, graphs=False)]
    costs = gpu_costs({"rows": rows}, "qwen3-8b")
    assert costs["batches"] == [8, 32]
    assert costs["tree_fixed_ms"] == pytest.approx(2.5)  # median of 2 and 3
    assert costs["tree_overhead"] == pytest.approx((1.5 + 2.0) / 2)  # (17-2)/10, (27-3)/12
    with pytest.raises(ValueError, match="no rows of tree4"):
        gpu_costs({"rows": rows}, "qwen3-1.7b")
