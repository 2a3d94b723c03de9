"""The training settings practitioners expect (issue 31): the learning-rate schedule, loss
aggregation (Dr. GRPO's constant normaliser), KL estimators, clip statistics by side,
top-k / top-p rollouts scored under the same processed distribution by the learner,
overlong filtering and dynamic sampling with refill."""

from __future__ import annotations

import math

import pytest
import torch

from specroll.rl.algo import loss as L
from specroll.rl.algo.logprobs import head_logprobs, sequence_logprobs, truncated
from specroll.rl.config import build_config
from specroll.rl.learner.schedule import lr_at, lr_factor
from specroll.rl.run.task import StepRewards, Task
from tests.conftest import make_trainer, step_batch
from tests.test_learner import tiny_batch, tiny_policy

# ---------------------------------------------------------------- the schedule


def _policy(*overrides: str):
    return build_config("tiny", list(overrides)).policy


def test_lr_warmup_then_linear_and_cosine_decay_by_hand():
    p = _policy("policy.lr=1.0", "policy.warmup_steps=2", "policy.lr_schedule=linear")
    # warmup 1/2, 2/2; then 1 - (s - 2) / (10 - 2)
    want = [0.5, 1.0] + [1 - k / 8 for k in range(8)]
    assert [lr_at(p, s, 10) for s in range(10)] == pytest.approx(want)
    c = _policy("policy.lr_schedule=cosine", "policy.min_lr_ratio=0.1")
    assert lr_factor(c, 0, 5) == 1.0
    assert lr_factor(c, 2, 4) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: cos = 0
    assert lr_factor(c, 100, 4) == pytest.approx(0.1)  # past the end: the floor
    assert lr_factor(_policy(), 7, 10) == 1.0  # constant, no warmup


@pytest.mark.parametrize(
    "setting, needle",
    [
        ("policy.lr_schedule=step", "policy.lr_schedule must be one of"),
        ("policy.warmup_steps=-1", "policy.warmup_steps must be >= 0"),
        ("policy.min_lr_ratio=0.5", "needs policy.lr_schedule 'linear' or 'cosine'"),
        ("loss.aggregation=sum", "loss.aggregation must be one of"),
        ("loss.kl_estimator=k4", "loss.kl_estimator must be one of"),
        ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
        ("rollout.top_k=-2", "rollout.top_k must be >= 0"),
        ("loss.max_refill_rounds=2", "needs loss.drop_uniform_groups=true"),
    ],
)
def test_new_settings_are_checked_naming_the_field(setting, needle):
    with pytest.raises(ValueError, match=None) as e:
        build_config("tiny", [setting])
    assert needle in str(e.value)


def test_refill_refuses_async_runs():
    with pytest.raises(ValueError, match="needs pipeline.max_lag=0"):
        build_config(
            "tiny",
            ["loss.drop_uniform_groups=true", "loss.max_refill_rounds=1", "pipeline.max_lag=1"],
        )


def test_retired_fields_name_their_replacement():
    for old, new in [
        ("loss.token_level=true", "loss.aggregation"),
        ("data.task=math", "data.train"),
        ("rollout.nodes=8", "rollout.k"),
        ("draft.kind=mtp", "rollout.drafter"),
    ]:
        with pytest.raises(ValueError, match=rf"^{old.split('=')[0]} is retired: set {new}"):
            build_config("tiny", [old])


# ---------------------------------------------------------------- loss pieces


def test_micro_shares_add_up_to_every_aggregation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, generator=g)
    m = torch.rand(6, 9, generator=g) > 0.3
    n_tok = float(m.sum())
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        whole = L.aggregate(x, m, agg, max_len=12)
        parts = sum(
            L.micro_share(x[i : i + 2], m[i : i + 2], n_tok, 6.0, agg, 12) for i in (0, 2, 4)
        )
        assert parts.item() == pytest.approx(whole.item(), abs=1e-6)
    # Dr. GRPO's weight per token does not depend on the sequence's length
    one = torch.ones(2, 4)
    short = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    per_tok = torch.autograd.functional.jacobian(
        lambda t: L.aggregate(t, short, "seq_mean_token_sum_norm", 8), one
    )
    assert per_tok[0, 0] == per_tok[1, 0] == 1 / 16


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(0.25) - math.log(0.5)  # log r
    assert L.kl_estimate(lp, ref, "k1").item() == pytest.approx(-d)
    assert L.kl_estimate(lp, ref, "k2").item() == pytest.approx(d * d / 2)
    assert L.kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 - d - 1)


def test_clip_fractions_by_side_by_hand():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]]))
    _, clipped = L.clipped_objective(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), 0.2, 0.28)
    low, high = L.clip_sides(logp.exp(), clipped, torch.tensor([1.0, -1.0]))
    assert high.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]  # r 1.5 > 1.28 with A > 0
    assert low.tolist() == [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]  # r 0.5 < 0.8 with A < 0


def test_a_token_outside_the_nucleus_adds_no_loss_and_no_nan():
    cfg = build_config("tiny", ["loss.kl_coef=0.1"]).loss
    logp = torch.tensor([[-1.0, -math.inf, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -0.5, -math.inf]])
    per_tok, terms = L.token_objective(logp, old, torch.tensor([1.0]), cfg, ref_logp=old)
    assert terms["support"].tolist() == [[True, False, False]]
    assert per_tok[0, 1:].tolist() == [0.0, 0.0] and torch.isfinite(per_tok).all()
    per_tok.sum().backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1:].tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- top-k / top-p


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.6), (12, 0.8)])
def test_chunked_head_scores_the_truncated_distribution(top_k, top_p):
    """Log-probs, gradients and entropy of the processed distribution: the chunked head
    against the plain path (and autograd through it)."""
    policy = tiny_policy().for_training()
    b = tiny_batch()
    n = policy.cfg.num_layers
    out = policy(b.tokens, hidden_layers=(n,))
    sel = b.response_mask[:, 1:]
    want = sequence_logprobs(out.logits, b.tokens, 0.7, top_k, top_p)[:, 1:][sel]
    h = out.hidden[n].detach().requires_grad_()
    final = policy.final_state(h)[:, :-1][sel]
    w = policy.head_weight
    got, _, ent = head_logprobs(
        final, w, b.tokens[:, 1:][sel], 0.7, chunk=7, top_k=top_k, top_p=top_p, entropy=True
    )
    inside = torch.isfinite(want)
    assert torch.equal(inside, torch.isfinite(got)) and 0 < inside.sum() < inside.numel()
    assert (got - want)[inside].abs().max() <= 1e-5
    z = truncated(out.logits[:, :-1][sel].detach().float() / 0.7, top_k, top_p)
    p = z.softmax(-1)
    assert (ent - torch.special.entr(p).sum(-1)).abs().max() <= 1e-5
    untruncated = (out.logits[:, :-1][sel].detach() / 0.7).softmax(-1)
    assert (ent < torch.special.entr(untruncated).sum(-1) - 1e-3).all()  # it did truncate
    # gradients of the kept tokens (the loss gives the others none: `token_objective`)
    plain = sequence_logprobs(policy.final_state(h) @ w, b.tokens, 0.7, top_k, top_p)
    gw_plain, gh_plain = torch.autograd.grad((plain[:, 1:][sel][inside] * 1.3).sum(), [w, h])
    gw, gh = torch.autograd.grad((got[inside] * 1.3).sum(), [w, h])
    for got_g, want_g in ((gw, gw_plain), (gh, gh_plain)):
        assert (got_g - want_g).abs().max() <= 1e-5 * want_g.abs().max()


def test_top_k_top_p_rollouts_stay_in_the_nucleus_and_match_the_learner(tiny_setup, tmp_path):
    """The engine samples from the processed distribution and reports its log-probs; the
    learner recomputes the same ones (the run's log-prob check passes) and no sampled
    token lies outside the top-k / nucleus set."""
    from specroll.rl.algo.mismatch import logprob_tolerance

    k, p, T = 6, 0.7, 0.9
    t = make_trainer(
        tiny_setup,
        tmp_path / "run",
        "data.prompts_per_step=2",
        "rollout.max_new_tokens=12",
        f"rollout.top_k={k}",
        f"rollout.top_p={p}",
        f"rollout.temperature={T}",
    )
    reqs = t.task.requests(t.task.problems(0), 4, base_seed=11)
    assert {(r.params.top_k, r.params.top_p) for r in reqs} == {(k, p)}
    batch = step_batch(t, samples=4)
    mask = batch.response_mask
    learner_logp = t.host.learner.logprobs(batch)
    err = (learner_logp - batch.behaviour_logp)[mask].abs().max()
    assert err <= logprob_tolerance(T)
    # independently of both: rank and nucleus membership from the policy's own logits
    policy = t.host.learner.policy
    with torch.no_grad():
        logits = policy(batch.tokens).logits.float() / T  # [N, W, V]
    z, tok = logits[:, :-1][mask[:, 1:]], batch.tokens[:, 1:][mask[:, 1:]]  # [n, V], [n]
    chosen = z.gather(1, tok[:, None])
    rank = (z > chosen).sum(-1)
    probs = z.softmax(-1)
    before = (probs * (z > chosen)).sum(-1)  # mass of the more likely tokens
    assert (rank < k).all() and (before < p + 1e-4).all()
    untruncated = z.log_softmax(-1).gather(1, tok[:, None])[:, 0]
    reported = batch.behaviour_logp[mask]
    assert (reported > untruncated + 1e-3).any()  # renormalised over the kept set
    stats = t.host.learner.train(batch, learner_logp)
    assert stats["outside_support"] == 0.0 and stats["entropy"] > 0


# ---------------------------------------------------------------- the step


def _even_scores(self, problems, results, samples):
    """`Task.score` with `_even_answers` (every reward of a step goes through it), reported
    as one function's values."""
    rewards = _even_answers(self, problems, results, samples)
    return StepRewards(rewards, {"even": rewards.clone()})


def _even_answers(self, problems, results, samples):
    """Rewards that make a group informative iff its answer is even (the tiny policy's
    own rewards are almost all 0): one sample of such a group scores 1."""
    out = torch.zeros(len(problems), samples)
    for i, prob in enumerate(problems):
        if int(prob.answer) % 2 == 0:
            out[i, 0] = 1.0
    return out


SMALL = (
    "data.prompts_per_step=4",
    "data.group_size=2",
    "rollout.max_new_tokens=6",
    "data.val_size=0",
    "rollout.speculative=false",
)


def test_refill_tops_up_informative_groups_from_fresh_prompts(tiny_setup, tmp_path, monkeypatch):
    monkeypatch.setattr(Task, "score", _even_scores)
    on = ("loss.drop_uniform_groups=true", "loss.max_refill_rounds=4", *SMALL)
    t = make_trainer(tiny_setup, tmp_path / "a", *on)
    own = t.task.problems(0)
    first = t.task.refill_problems(0, 1, own)
    assert first == t.task.refill_problems(0, 1, own)  # a pure function of (seed, step, round)
    assert not {p.prompt for p in first} & {p.prompt for p in own}
    assert first != t.task.refill_problems(0, 2, own) != t.task.refill_problems(1, 1, own)
    m = t.run_step()
    assert m["groups_kept"] == 4 and m["refill_rounds"] >= 1
    assert m["groups"] == 4 + m["refill_groups"] and m["refill_tokens"] > 0
    assert m["gen_tokens"] == sum(m["response_lengths"])  # the refill rounds included
    # each function's metric covers every round, as the advantages and `reward` do
    assert m["reward/even"] == m["reward"] and m["reward"] > 0
    assert m["time"]["gen"] > 0 and m["time"]["reward"] >= 0
    drop = make_trainer(tiny_setup, tmp_path / "b", "loss.drop_uniform_groups=true", *SMALL)
    md = drop.run_step()
    assert md["groups"] == 4 and "refill_rounds" not in md
    assert md["groups_kept"] == sum(int(p.answer) % 2 == 0 for p in own) < 4


def test_mask_truncated_leaves_cut_responses_out(tiny_setup, tmp_path, monkeypatch):
    monkeypatch.setattr(Task, "score", _even_scores)
    t = make_trainer(tiny_setup, tmp_path / "a", "loss.mask_truncated=true", *SMALL)
    m = t.run_step()  # six tokens: the random tiny policy rarely stops that soon
    cut = sum(n == 6 for n in m["response_lengths"])  # (none of this seed stops at 6)
    assert 0 < m["masked_truncated"] == cut < 8 and m["lr"] > 0
    assert m["logprob_mismatch_max"] is not None  # the stopped responses were trained on
