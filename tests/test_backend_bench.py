"""`specroll bench backends` (`specroll.rl.rollout.bench`) on a tiny policy and draft.

The own engine only here (the vLLM side runs in tests/test_vllm.py): every (batch, mode)
gets a row with its per-round figures, EAGLE-3 rows carry an acceptance length the depth
allows and a speed-up against the same round's plain run, and bad input names its field.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from specroll.drafting.eagle3_head import Eagle3Config, Eagle3Head
from specroll.drafting.eagle3_io import save_eagle3
from specroll.model import ModelConfig, Transformer
from specroll.model.weights import save_model
from specroll.rl.rollout.bench import bench_backends, bench_requests


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = ModelConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=256,
    )
    target = Transformer(cfg).init_weights(seed=0, std=0.15).eval()
    draft = Eagle3Head(Eagle3Config.from_layer(cfg, 24, (1, 2, 3)), embed=target)
    root = tmp_path_factory.mktemp("bench")
    save_model(target, root / "policy")
    save_eagle3(draft.init_weights(1, 0.3).eval(), root / "draft")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (n,), generator=g).tolist() for n in (3, 7, 5)]
    return target, prompts, root


def test_rows_cover_every_batch_and_mode_with_per_round_figures(tiny):
    target, prompts, root = tiny
    k, repeats = 3, 2
    report = bench_backends(
        target,
        prompts,
        root / "policy",
        root / "draft",
        batches=[1, 4],
        k=k,
        new_tokens=6,
        repeats=repeats,
        backends=("local",),
        log=lambda _: None,
    )
    rows = {(r["batch"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {(1, "ar"), (1, "eagle3"), (4, "ar"), (4, "eagle3")}
    for r in rows.values():
        assert r["backend"] == "local" and len(r["tok_s_runs"]) == repeats
        assert r["tok_s"] == pytest.approx(statistics.median(r["tok_s_runs"]), abs=0.01)
        assert "own_over_vllm" not in r  # only with both backends in the same process
    for B in (1, 4):
        spec = rows[(B, "eagle3")]
        assert 1.0 <= spec["acceptance_length"] <= k + 1
        assert len(spec["per_position"]) == k and spec["speedup_vs_ar"] > 0
    assert report["config"]["new_tokens"] == 6 and report["config"]["backends"] == ["local"]


def test_requests_are_seeded_by_row_with_stop_tokens_off():
    reqs = bench_requests([[1, 2], [3]], batch=3, new_tokens=5, temperature=1.0)
    assert [r.prompt_ids for r in reqs] == [[1, 2], [3], [1, 2]]
    assert [r.params.seed for r in reqs] == [0, 1, 2]
    assert all(r.params.stop_token_ids == () and r.params.max_new_tokens == 5 for r in reqs)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(backends=("sglang",)), "backends"),
        (dict(batches=[0]), "batches"),
        (dict(repeats=0), "repeats"),
        (dict(draft_dir="/nonexistent"), "draft"),
    ],
)
def test_bad_settings_name_their_field(tiny, kw, field):
    target, prompts, root = tiny
    args = dict(batches=[1], backends=("local",), draft_dir=None) | kw
    with pytest.raises(ValueError, match=field):
        bench_backends(target, prompts, root / "policy", **args)
