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
    assert moe._weights_read(1) < moe._weights_read(64) < moe._weights_read(4096)


def test_rollout_simulation_batch_shrinks_and_speculation_helps_the_tail():
    from specroll.sim.costmodel import CostModel
    from specroll.sim.rollout import Speculation, Workload, simulate_rollout

    sp = Speculation.from_acceptance_length(2.5, 3)
    assert sp.tau(3) == pytest.approx(2.5, rel=1e-6) and sp.tau(0) == 1.0
    # a memory-bound machine: verifying 4 tokens costs what 1 does, drafting is cheap
    cm = CostModel(fixed=0.01, per_token=1e-4, knee=64, draft_step=5e-4)
    w = Workload(prompts=4, samples=8, mean_len=200, sigma=1.0, max_len=1000)
    ar = simulate_rollout(cm, w, replicas=1, max_batch=16, spec=Speculation())
    spec = simulate_rollout(cm, w, replicas=1, max_batch=16, spec=sp)
    assert ar["trace"][0][1] == 16 and ar["trace"][-1][1] < 16  # the batch shrinks
    assert 1.5 < ar["gen_s"] / spec["gen_s"] < 2.5
    adaptive = simulate_rollout(cm, w, 1, 16, Speculation(3, sp.alphas, adaptive=True))
    assert adaptive["gen_s"] <= spec["gen_s"] * 1.001
