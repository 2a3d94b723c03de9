"""On a CUDA device: parity with transformers, exactness, a training run, `bench engine`.

Marked `gpu` and skipped, with the reason shown, where torch sees no CUDA device (CI's
CPU machines): they never pass without running. On a GPU machine run them with
`python -m pytest -m gpu -rs` (the default `-m 'not slow'` selection includes them too).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["llama-tied", "qwen2-bias", "qwen3-qknorm"])
def test_logits_match_transformers_on_gpu(hf_dirs, variant, dtype):
    """Same weights, same device and dtype: specroll's logits are transformers' (bf16:
    both round the same products, so they agree to bf16 precision of the logit scale)."""
    from specroll.model import load_model

    hf, path = hf_dirs[variant]
    hf = hf.to("cuda", dtype)
    ours = load_model(path).to(device="cuda", dtype=dtype).eval()
    x = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        ref, out = hf(x).logits.float(), ours(x).logits
    assert out.dtype == torch.float32 and out.device.type == "cuda"
    tol = 1e-4 if dtype == torch.float32 else 0.05 * float(ref.abs().max())
    assert (ref - out).abs().max() <= tol
    hf.to("cpu", torch.float32)  # the session fixture is shared with CPU tests


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("drafter", ["draft_model", "eagle3"])
def test_speculative_joint_distribution_is_exact_on_gpu(drafter, dtype, graphs):
    """The CPU suite's chi-square test (tests/test_spec_engine.py), on the GPU: the
    three-token joint of speculative decoding against the exact plain-decoding one of the
    same (GPU, dtype) model, with the same power check; eager, and replayed as CUDA
    graphs (`engine.graphs`)."""
    from specroll.engine import Engine, EngineConfig
    from specroll.engine.depth import FixedDepth
    from tests.conftest import (
        JOINT_SAMPLES,
        chi2_pvalue,
        exact_joint,
        sample_joint,
        spec_drafters,
        spec_model,
        tv_shifted,
    )

    target = spec_model(0).to(device="cuda", dtype=dtype)
    make = spec_drafters(target)[drafter]
    d = make()
    if d.network is not None:
        d.network.to(device="cuda", dtype=dtype)
    config = EngineConfig(max_batch=512, cuda_graphs=graphs)
    engine = Engine(target, config, drafter=d, depth=FixedDepth(3))
    counts = sample_joint(engine, JOINT_SAMPLES, 1.0, 0, 1.0, mixed=True).cpu()
    s = engine.stats
    assert s.draft_tokens > JOINT_SAMPLES // 2 and s.acceptance_rate < 0.95
    assert (s.graphs > 0) == graphs
    exact = exact_joint(target, 1.0, 0, 1.0).cpu()
    assert chi2_pvalue(counts, exact) > 1e-4
    assert chi2_pvalue(counts, tv_shifted(exact, 0.02)) < 1e-4


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("drafter", ["full-fan", "history"])
def test_tree_joint_distribution_is_exact_on_gpu(drafter, dtype, graphs):
    """tests/test_tree.py's chi-square test on the GPU: draft trees (every first token a
    candidate; the history drafter over remembered rollouts and live siblings) against
    the exact plain-decoding joint of the same (GPU, dtype) model."""
    from specroll.drafters.history import HistoryDrafter
    from specroll.engine import Engine, EngineConfig
    from specroll.engine.depth import FixedDepth
    from tests.conftest import (
        JOINT_SAMPLES,
        PROMPT,
        chi2_pvalue,
        exact_joint,
        sample_joint,
        spec_model,
        tv_shifted,
    )
    from tests.test_tree import FullFan

    target = spec_model(0).to(device="cuda", dtype=dtype)
    if drafter == "history":
        d = HistoryDrafter()
        for i in range(16):
            d.remember(PROMPT, [(3 * i + j) % 16 for j in range(5)])
    else:
        d = FullFan()
    config = EngineConfig(max_batch=512, cuda_graphs=graphs)
    engine = Engine(target, config, drafter=d, depth=FixedDepth(32))
    counts = sample_joint(engine, JOINT_SAMPLES, 1.0, 0, 1.0, mixed=True).cpu()
    assert engine.stats.accepted_tokens > JOINT_SAMPLES // 4
    assert (engine.stats.graphs > 0) == graphs
    exact = exact_joint(target, 1.0, 0, 1.0).cpu()
    assert chi2_pvalue(counts, exact) > 1e-4
    assert chi2_pvalue(counts, tv_shifted(exact, 0.02)) < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_training_run_on_gpu(tmp_path, monkeypatch, dtype):
    """`specroll train --preset tiny --device cuda`: every stage on the GPU, finite losses,
    the mismatch statistics recorded, and in fp32 the engine's log-probs still within
    the stated bound of the learner's."""
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path / "home"))
    from specroll.model import load_model
    from specroll.model.hub import resolve
    from specroll.model.tokenizer import Tokenizer
    from specroll.rl.algo.mismatch import logprob_tolerance
    from tests.conftest import make_trainer

    d = resolve("tiny")
    over = ["pipeline.steps=2", "rollout.device=cuda", "learner.device=cuda"]
    over += [f"rollout.dtype={dtype}", f"learner.dtype={dtype}"]
    trainer = make_trainer((load_model(d), Tokenizer(d)), tmp_path / "run", *over, log=print)
    history = [m for m in trainer.run() if "time" in m]
    assert len(history) == 2
    assert all(m["logprob_mismatch_max"] is not None for m in history[:1])
    if dtype == "float32":
        assert history[0]["logprob_mismatch_max"] <= logprob_tolerance(1.0)
    assert all(torch.isfinite(torch.tensor(m["policy_loss"])) for m in history)


def test_bench_engine_on_gpu_against_transformers():
    """`specroll bench engine --device cuda` on the tiny model: the JSON line names the
    device and both engines' throughput (the SmolLM2 figures are in the README)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "specroll.cli",
            "bench",
            "engine",
            "--model",
            "tiny",
            "--device",
            "cuda",
        ]
        + ["--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["config"]["device"].startswith("cuda")
