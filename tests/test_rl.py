"""The RL loop: loss functions against hand-computed values, gradient isolation between
policy and draft, online draft learning, versioned sync, config errors. (Exact resume of
a single-process run: tests/test_hostile_run.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from specroll.rl.algo import advantages as A
from specroll.rl.algo import loss as L
from specroll.rl.config import build_config
from tests.conftest import make_trainer, step_batch


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    adv = A.group_advantages(r, eps=0.0 + 1e-12)
    assert torch.allclose(adv[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))  # mean .5, std .5
    assert torch.equal(adv[1], torch.zeros(4))
    assert torch.allclose(
        A.group_advantages(r, scale=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5])
    )
    assert A.informative_groups(r).tolist() == [True, False]


def test_clipped_objective_clip_higher_by_hand():
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    loss, clipped = L.clipped_objective(
        logp, old, torch.tensor([1.0]), clip_low=0.2, clip_high=0.28
    )
    # A > 0: min(r, clip(r)) → 1.28, 0.5, 1.1
    assert torch.allclose(loss, -torch.tensor([[1.28, 0.5, 1.1]]))
    assert clipped.tolist() == [[1.0, 0.0, 0.0]]
    loss, clipped = L.clipped_objective(
        logp, old, torch.tensor([-2.0]), clip_low=0.2, clip_high=0.28
    )
    # A < 0: min(-2r, -2clip(r)) → -3.0, -1.6 (clipped at 0.8), -2.2
    assert torch.allclose(loss, torch.tensor([[3.0, 1.6, 2.2]]))
    assert clipped.tolist() == [[0.0, 1.0, 0.0]]


def test_aggregation_token_vs_sequence_level():
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert L.aggregate(x, m, "token_mean").item() == pytest.approx(8 / 5)
    assert L.aggregate(x, m, "seq_mean_token_mean").item() == pytest.approx((1 + 4) / 2)
    # Dr. GRPO: each sequence's sum over a constant budget, then the mean over sequences
    assert L.aggregate(x, m, "seq_mean_token_sum_norm", 8).item() == pytest.approx((4 + 4) / 16)


def test_overlong_penalty_and_kl_by_hand():
    p = A.overlong_penalty(torch.tensor([10, 90, 95, 100, 120]), max_len=100, buffer=10)
    assert torch.allclose(p, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    assert torch.equal(A.overlong_penalty(torch.tensor([100]), 100, 0), torch.zeros(1))
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert L.kl_k3(lp, ref).item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert L.kl_k3(lp, lp).item() == 0.0


# ---------------------------------------------------------------------- learner


def _trainer(tiny_setup, tmp_path, *overrides, log=None):
    return make_trainer(tiny_setup, tmp_path / "run", *overrides, log=log)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_policy_and_draft_gradients_are_isolated(tiny_setup, tmp_path, kind):
    t = _trainer(tiny_setup, tmp_path, f"rollout.drafter={kind}")
    learner = t.host.learner
    policy, draft = learner.policy, learner.draft
    assert draft.kind == kind
    batch = step_batch(t)
    old = learner.logprobs(batch) - 0.05  # ratios != 1: a non-trivial policy gradient
    # the learner's own forward: log-probs, the draft's target and the policy states
    logp, target, hidden = learner.forward(policy, batch, learner.draft_vocab())
    pl, _ = L.clipped_objective(logp, old, batch.advantages, 0.2, 0.28)
    policy_loss = L.aggregate(pl, batch.response_mask, "token_mean")
    draft_loss, _ = learner.draft_loss(batch, hidden, target)
    p_params, d_params = list(policy.parameters()), list(draft.parameters())
    g = torch.autograd.grad(draft_loss, p_params + d_params, allow_unused=True, retain_graph=True)
    assert all(x is None or torch.count_nonzero(x) == 0 for x in g[: len(p_params)])
    assert any(x is not None and torch.count_nonzero(x) > 0 for x in g[len(p_params) :])
    g = torch.autograd.grad(policy_loss, p_params + d_params, allow_unused=True)
    assert all(x is None or torch.count_nonzero(x) == 0 for x in g[len(p_params) :])
    assert any(x is not None and torch.count_nonzero(x) > 0 for x in g[: len(p_params)])


def test_engine_logprobs_match_learner_and_versions_are_checked(tiny_setup, tmp_path):
    t = _trainer(tiny_setup, tmp_path)
    m = t.run_step()
    from specroll.rl.algo.mismatch import logprob_tolerance

    assert m["logprob_mismatch_max"] <= logprob_tolerance(t.cfg.rollout.temperature)
    assert t.cfg.rollout.temperature == 1.0 and m["logprob_mismatch_max"] <= 1e-5  # strict at T=1
    assert m["policy_version"] == 1 and t.rollout.policy_version == 1
    assert t.rollout.draft_version == 1
    # a stale engine must be caught, not silently trained on
    t.rollout.update_weights(0, t.host.weights())
    with pytest.raises(RuntimeError, match="versions"):
        t.run_step()


def test_sync_refuses_a_mismatched_draft(tiny_setup, tmp_path):
    from specroll.drafting.train import new_eagle3
    from specroll.rl.replica import Weights

    t = _trainer(tiny_setup, tmp_path)
    policy, draft = t.host.learner.policy, t.host.learner.draft
    other = new_eagle3(policy, torch.arange(32), draft.cfg.aux_layers, 0)
    with pytest.raises(ValueError, match="lm_head"):
        t.rollout.update_weights(1, Weights.of(policy, other))
    with pytest.raises(ValueError, match="names differ"):
        t.rollout.update_weights(1, Weights({"no_such_tensor": next(iter(policy.parameters()))}))
    assert t.rollout.policy_version == 0  # nothing half-loaded is stamped new


def test_online_draft_improves_acceptance(tiny_setup, tmp_path):
    """A random draft on the tiny policy, trained online only, accepts more over steps
    (the learner's expected acceptance on each batch; speculation off in generation, so
    the rollouts it is measured on do not depend on the draft being trained). The policy
    is held still: the tiny preset's learning rate moves a random policy faster than
    a draft can follow."""
    t = _trainer(
        tiny_setup,
        tmp_path,
        "pipeline.steps=12",
        "policy.lr=1e-12",
        "draft.lr=3e-3",
        "data.val_size=0",
        "rollout.speculative=false",
    )
    accepts = [t.run_step()["draft_accept"][0] for _ in range(12)]
    assert sum(accepts[-3:]) / 3 > sum(accepts[:3]) / 3 + 0.05, accepts


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="unknown config key loss.clip_hi;"):
        build_config("tiny", ["loss.clip_hi=0.3"])
    with pytest.raises(ValueError, match="rollout.k must be >= 0"):
        build_config("tiny", ["rollout.k=-1"])
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        build_config("huge")
    with pytest.raises(ValueError, match="section.key=value"):
        build_config("tiny", ["steps=3"])
    assert build_config("default", ["loss.clip_high=0.3"]).loss.clip_high == 0.3
    with pytest.raises(
        ValueError, match=r"rollout.backend must be one of \('local', 'ray', 'vllm'\)"
    ):
        build_config("tiny", ["rollout.backend=sglang"])
    with pytest.raises(ValueError, match="unknown config key ray.enabled; ray has:"):
        build_config("tiny", ["ray.enabled=true"])
    with pytest.raises(ValueError, match=r"learner.placement must be one of \('auto', 'local'"):
        build_config("tiny", ["learner.placement=cloud"])
    placed = {
        over: build_config("tiny", list(over)).learner_placement()
        for over in [
            (),
            ("rollout.backend=ray",),
            ("rollout.backend=ray", "learner.placement=local"),
            ("learner.placement=ray",),
        ]
    }
    assert list(placed.values()) == ["local", "ray", "local", "ray"]
    with pytest.raises(ValueError, match=r"rollout.drafter must be one of .*eagle3.*mtp"):
        build_config("tiny", ["rollout.drafter=medusa"])


def test_dapo_style_file_task(tmp_path):
    from specroll.tasks.sets import load_file

    f = tmp_path / "dapo.jsonl"
    rec = {
        "prompt": [{"role": "user", "content": "What is 2+2?"}],
        "reward_model": {"ground_truth": "4"},
    }
    f.write_text(json.dumps(rec) + "\n" + json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    items = load_file(f)
    assert [(p.prompt, p.answer) for p in items] == [("What is 2+2?", "4"), ("1+1?", "2")]
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_file(tmp_path / "bad.jsonl")


def test_trainer_accepts_a_policy_that_already_ran_inference(tiny_setup, tmp_path):
    """The default run samples draft data with the policy (prepacking its weights for
    oneDNN) before building the trainer, which copies the policy for the engine."""
    policy, _ = tiny_setup
    with torch.inference_mode():
        policy(torch.zeros(1, 4, dtype=torch.long))
    _trainer(tiny_setup, tmp_path, "loss.kl_coef=0.01").run_step()


def _err(capsys) -> str:
    return "".join(capsys.readouterr().err.split("\n"))  # rich wraps long lines


def test_bad_task_files_fail_before_any_model_is_loaded(tmp_path, capsys):
    from specroll.cli import main

    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps({"prompt": "1+1?"}) + "\n")
    assert main(["train", "--preset", "tiny", "--set", f"data.train={f}"]) == 2
    assert "without an answer" in _err(capsys)
    f.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": \n')
    assert main(["train", "--preset", "tiny", "--set", f"data.train={f}"]) == 2
    assert "t.jsonl:2: not valid JSON" in _err(capsys)
    assert main(["train", "--preset", "tiny", "--set", "data.train=/no/such.jsonl"]) == 2
    assert "data.train: no such file" in _err(capsys)


@pytest.mark.parametrize(
    "overrides", [(), ("loss.kl_coef=0.05", "loss.aggregation=seq_mean_token_mean")]
)
def test_a_learner_step_emits_no_warnings(tiny_setup, tmp_path, overrides):
    """Statistics are read from detached tensors: no 'requires_grad ... to a scalar'."""
    import warnings

    t = _trainer(tiny_setup, tmp_path, *overrides)
    batch = step_batch(t)
    old = t.host.learner.logprobs(batch) - 0.05
    t.host.learner.decoupled = True  # the async path reads behaviour weights too
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = t.host.learner.train(batch, old, ref_logp=old + 0.01)
    # the figures of this update: pi / pi_old = e^0.05 at every token, a real gradient
    assert stats["ratio_mean"] == pytest.approx(math.exp(0.05), rel=1e-4)
    assert stats["grad_norm"] > 0
    if overrides:
        assert stats["kl"] > 0


def test_logprob_tolerance_bounds_log_softmax_under_logit_error():
    """|d log_softmax(z / T)| <= 2 eps / T whenever |d z| <= eps, and the bound is tight."""
    from specroll.rl.algo.mismatch import EPS_LOGIT, logprob_tolerance

    g = torch.Generator().manual_seed(0)
    eps = 1e-3
    for T in (1.0, 0.7, 0.45):
        z = torch.randn(64, 500, generator=g, dtype=torch.float64) * 5
        dz = (torch.rand(64, 500, generator=g, dtype=torch.float64) * 2 - 1) * eps
        d = ((z + dz) / T).log_softmax(-1) - (z / T).log_softmax(-1)
        assert d.abs().max() <= logprob_tolerance(T, eps)
        # worst case: one token up by eps, all others down, on a flat distribution
        flat = torch.zeros(1, 10_000, dtype=torch.float64)
        worst = torch.full_like(flat, -eps)
        worst[0, 0] = eps
        gap = ((flat + worst) / T).log_softmax(-1)[0, 0] - (flat / T).log_softmax(-1)[0, 0]
        assert gap >= 0.99 * logprob_tolerance(T, eps)
    assert logprob_tolerance(0.0) == logprob_tolerance(1.0) == 2 * EPS_LOGIT  # greedy: T = 1
    assert logprob_tolerance(0.45) == pytest.approx(2 * EPS_LOGIT / 0.45)


def test_shadow_rollouts_measure_plain_decoding_and_change_nothing(tiny_setup, tmp_path):
    """Shadow steps decode the same requests without speculation for the speed-up
    figures, and discard them: training is the same as without them."""
    import copy

    from tests.test_reproducible import deterministic

    policy, tok = tiny_setup
    untouched = (copy.deepcopy(policy), tok)  # each learner trains its own policy in place
    t = _trainer(tiny_setup, tmp_path / "a", "pipeline.shadow_every=1")
    plain = _trainer(untouched, tmp_path / "b")
    shadowed = [t.run_step() for _ in range(2)]
    rows = [plain.run_step() for _ in range(2)]
    for m, ref in zip(shadowed, rows, strict=True):
        assert m["shadow_ar_gen_tokens"] > 0
        # both times are logged rounded to the millisecond: their ratio is known to the
        # sum of their relative roundings (a few per cent on a tiny run's ~20 ms)
        shadow_s, gen_s = m["shadow_ar_gen_s"], m["time"]["gen"]
        rel = 2e-3 + 5e-4 / shadow_s + 5e-4 / gen_s
        assert m["gen_speedup"] == pytest.approx(shadow_s / gen_s, rel=rel)
        rate = (m["gen_tokens"] / gen_s) / (m["shadow_ar_gen_tokens"] / shadow_s)
        assert m["gen_rate_speedup"] == pytest.approx(rate, rel=rel)
        assert 0.0 <= m["shadow_ar_reward"] <= 1.0  # the plain samples, scored
        extra = {"shadow_ar_gen_tokens", "gen_speedup", "gen_rate_speedup", "shadow_ar_reward"}
        assert {k: v for k, v in deterministic(m).items() if k not in extra} == deterministic(ref)


def test_mismatch_statistics_by_hand():
    from specroll.rl.algo.mismatch import mismatch_stats

    engine = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.2, 0.3]]))
    learner = torch.log(torch.tensor([[0.4, 0.25, 0.3], [0.2, 0.2, 0.3]]))
    mask = torch.tensor([[True, True, False], [True, False, False]])  # 0.9 vs 0.3 not compared
    st = mismatch_stats(engine, learner, mask)
    d = [math.log(0.4 / 0.5), 0.0, math.log(0.2 / 0.1)]  # log r = log pi_learner / pi_engine
    assert st["logprob_mismatch_mean"] == pytest.approx(sum(abs(x) for x in d) / 3)
    assert st["logprob_mismatch_max"] == pytest.approx(math.log(2))
    kl = [math.exp(x) - 1 - x for x in d]  # k3: r - 1 - log r
    assert st["mismatch_kl"] == pytest.approx(sum(kl) / 3)
    assert all(v is None for v in mismatch_stats(engine, learner, mask & False).values())


def test_recompute_auto_trains_on_engine_logprobs_and_checks_them(tiny_setup, tmp_path):
    """auto: the first step and every check_every-th recompute (as a check) and still train
    on the engine's log-probs; the steps between do not recompute at all; the losses are
    those of `always` to float rounding (the two log-probs agree to ~1e-6 in fp32)."""
    from specroll.model import load_model
    from specroll.model.hub import resolve

    auto = _trainer(tiny_setup, tmp_path / "a", "learner.check_every=2")
    calls = []
    real = auto.host.logprobs
    auto.host.logprobs = lambda b, exact=False: calls.append(exact) or real(b, exact)
    ms = [auto.run_step() for _ in range(3)]
    assert [m["logprob_source"] for m in ms] == ["engine"] * 3
    assert [m["logprob_check"] for m in ms] == [True, None, True] and calls == [False] * 2
    assert ms[1]["logprob_mismatch_max"] is None and ms[0]["logprob_mismatch_max"] <= 1e-5
    always = _trainer(
        (load_model(resolve("tiny")), tiny_setup[1]),
        tmp_path / "b",
        "learner.recompute_logprobs=always",
    )
    ma = [always.run_step() for _ in range(3)]
    assert [m["logprob_source"] for m in ma] == ["learner"] * 3
    assert all(m["logprob_mismatch_max"] is not None for m in ma)
    for a, b in zip(ms, ma, strict=True):
        assert a["reward"] == b["reward"]  # same rollouts: step 0's weights are the same
        assert a["policy_loss"] == pytest.approx(b["policy_loss"], abs=1e-5)


def test_recompute_auto_falls_back_when_a_check_fails(tiny_setup, tmp_path):
    logs: list[str] = []
    t = _trainer(tiny_setup, tmp_path, "learner.check_every=1", log=logs.append)
    real = t.host.logprobs
    t.host.logprobs = lambda b, exact=False: (real(b)[0] - 0.01 * b.response_mask, None)  # bad
    m = t.run_step()
    assert m["logprob_check"] is False and m["logprob_source"] == "learner"
    assert m["logprob_mismatch_max"] == pytest.approx(0.01, rel=1e-3)
    assert t.old_logprobs.fallback
    assert any("recomputing the log-probs from now on" in x for x in logs)
    m = t.run_step()  # from now on: recomputed every step, no check
    assert m["logprob_source"] == "learner" and m["logprob_check"] is None
    assert t.checkpoint_state()["logprob_fallback"] is True  # survives a resume


def test_recompute_auto_is_off_where_engine_logprobs_are_not_the_old_ones():
    from specroll.rl.algo.old_logprobs import engine_usable

    assert engine_usable(build_config("tiny"))
    for over in (
        "rollout.dtype=bfloat16",
        "learner.dtype=bfloat16",
        "pipeline.max_lag=1",
        "loss.kl_coef=0.1",
        "learner.recompute_logprobs=always",
    ):
        assert not engine_usable(build_config("tiny", [over])), over
