"""`learner.dtype: auto` and a bf16 learner over fp32 rollouts: the dtype follows the
measured speed of bf16 products, and the old log-probs come from the update's own
forward with fp32 checks (`rl.algo.old_logprobs.update_usable`)."""

from __future__ import annotations

from tests.conftest import make_trainer, step_batch


def test_a_bf16_learner_takes_old_logprobs_from_its_update_and_checks_in_fp32(tiny_setup, tmp_path):
    """A bf16 learner over an fp32 engine: the update's own forward gives the old
    log-probs (the ratio is exactly 1 on-policy), and the check recomputes in fp32, so the
    engine's log-probs meet the fp32 bound (bf16 rounding alone would be far above it);
    a failed check recomputes in the learner's dtype from then on."""
    t = make_trainer(tiny_setup, tmp_path / "a", "learner.dtype=bfloat16", "learner.check_every=2")
    calls = []
    real = t.host.logprobs
    t.host.logprobs = lambda b, exact=False: calls.append(exact) or real(b, exact)
    ms = [t.run_step() for _ in range(3)]
    assert [m["logprob_source"] for m in ms] == ["update"] * 3
    assert [m["logprob_check"] for m in ms] == [True, None, True] and calls == [True, True]
    assert ms[0]["logprob_mismatch_max"] <= 1e-5  # fp32 against fp32
    assert all(m["ratio_max"] == m["ratio_min"] == 1.0 for m in ms)
    batch = step_batch(t)  # the learner's bf16 log-probs differ by more than the bound
    bf16, fp32 = t.host.learner.logprobs(batch), t.host.learner.logprobs(batch, exact=True)
    assert (bf16 - fp32).abs().max() > 1e-3
    logs: list[str] = []
    u = make_trainer(tiny_setup, tmp_path / "b", "learner.dtype=bfloat16", log=logs.append)
    real_u = u.host.logprobs
    u.host.logprobs = lambda b, exact=False: (real_u(b, exact)[0] + 0.01 * b.response_mask, None)
    m = u.run_step()
    assert m["logprob_check"] is False and m["logprob_source"] == "learner"
    assert u.old_logprobs.fallback and any("from now on" in x for x in logs)


def test_learner_dtype_auto_follows_the_measured_speed(tmp_path, monkeypatch):
    """learner.dtype auto is bf16 only where bf16 products measure clearly faster, and the
    measurement is kept per machine (a second run reads it instead of timing again)."""
    import torch

    from specroll import device as dev
    from specroll.rl.config import build_config
    from specroll.rl.learner.build import with_learner_dtype

    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))
    cpu = torch.device("cpu")
    monkeypatch.setattr(dev, "_time_product", lambda d, bf16, r: 1.0 if bf16 else 2.0)
    cfg = build_config("tiny", ["learner.dtype=auto"])
    logs: list[str] = []
    assert with_learner_dtype(cfg, logs.append).learner.dtype == "bfloat16"
    assert "2.00x" in logs[0]
    monkeypatch.setattr(dev, "_time_product", lambda d, bf16, r: 3.0 if bf16 else 2.0)
    assert with_learner_dtype(cfg, logs.append).learner.dtype == "bfloat16"  # kept
    assert dev.learner_dtype(cpu, None)[0] == "float32"  # measured afresh: slower
    assert with_learner_dtype(build_config("tiny"), logs.append).learner.dtype == "float32"
