"""The combined drafter (history + a draft network) and adaptive tree size.

* the conditional case for the combined drafter: history held fixed, fresh seeds, every
  rollout is plain decoding's for its seed (deterministic, as for the history drafter in
  `tests.test_tree`), with candidates of both sources taken; under -m slow, with the
  history learning and the sampled chain at a budget of 2, the joint law of three tokens
  is the target's (chi-square, the suite's method and thresholds);
* greedy: token-identical to plain decoding;
* it picks itself: a history that knows the answers wins the tree, an empty one leaves
  it to the draft network;
* adaptive tree size: a verified tree tells exactly what every smaller budget would have
  emitted (the counterfactual the size policy learns from), and the policy's estimate.
"""

from __future__ import annotations

import pytest
import torch

from specroll.drafters.base import FormReport
from specroll.drafters.combined import CombinedDrafter
from specroll.drafters.history import HistoryDrafter
from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine.costmodel import CostModel
from specroll.engine.depth import AdaptiveDepth, FixedDepth
from specroll.engine.forms import CHAIN_UP_TO, PROBE_EVERY, FormChoice
from specroll.spec import tree
from specroll.spec.sampling import RowSampling
from tests.conftest import (
    JOINT_SAMPLES,
    PROMPT,
    VOCAB,
    chi2_pvalue,
    exact_joint,
    sample_joint,
    spec_drafters,
    spec_model,
    tv_shifted,
)
from tests.test_tree import N_DET, _assert_plain_tokens, _requests


@pytest.fixture(scope="module")
def target():
    return spec_model(0)


def _combined(target, history: HistoryDrafter | None = None) -> CombinedDrafter:
    return CombinedDrafter(history or HistoryDrafter(), spec_drafters(target)["eagle3"]())


def _kinds(drafter: CombinedDrafter) -> list[str]:
    """Spy on `drafter`'s proposals: the list it returns fills with "chain" (the network's
    sampled chain) or "tree" (merged candidates), one per proposal."""
    kinds, propose = [], drafter.propose

    def spy(batch):
        out = propose(batch)
        kinds.append("tree" if out.parents is not None else "chain")
        return out

    drafter.propose = spy
    return kinds


def _outputs(target, n: int, t: float, seed0: int, tokens: int = 5) -> list[list[int]]:
    engine = Engine(target, EngineConfig(max_batch=64))
    params = [
        SamplingParams(t, max_new_tokens=tokens, stop_token_ids=(), seed=seed0 + i)
        for i in range(n)
    ]
    return [r.token_ids for r in engine.generate([Request(PROMPT, q) for q in params])]


def test_the_combined_drafter_gives_plain_decodings_tokens(target, monkeypatch):
    """8 old rollouts held fixed, a random-init EAGLE-3 head, merged trees of 16 nodes,
    fresh seeds with draft caps 0..2 and uncapped side by side: every rollout is plain
    decoding's draw for its own seed (but for a rounding flip at a CDF boundary,
    `tests.test_tree._assert_plain_tokens`), whatever the trees hold — so a fresh sample
    of the policy given its prefix (the conditional law) — and candidates of both
    sources were verified and taken."""
    t, k, p = 1.0, 0, 1.0
    history = HistoryDrafter(sources=("prompt", "past"))
    for out in _outputs(target, 8, t, seed0=77):
        history.remember(PROMPT, out)
    history.learn = False
    drafter = _combined(target, history)
    engine = Engine(target, EngineConfig(max_batch=N_DET), drafter, FixedDepth(16))
    _assert_plain_tokens(target, engine, _requests(t, k, p, N_DET, 16), monkeypatch)
    assert engine.stats.accepted_tokens > N_DET
    for source in ("history", "draft"):
        assert drafter.taken[source] > 0 and drafter.predicted[source] > 0, source


@pytest.mark.parametrize("budget", [2, 12])
def test_greedy_combined_drafts_are_token_identical_to_plain(target, budget):
    """A budget of 12: merged trees only; of 2 (`CHAIN_UP_TO`): the head's sampled chain
    and the tree, each tried first while unmeasured (which one wins after that reads
    wall time: `test_the_small_budget_choice_is_per_second_not_per_token`)."""
    reqs = [
        Request(PROMPT, SamplingParams(0.0, max_new_tokens=48, stop_token_ids=(), seed=i))
        for i in range(4)
    ]
    plain = Engine(target, EngineConfig(max_batch=4)).generate(reqs)
    drafter = _combined(target)
    kinds = _kinds(drafter)
    engine = Engine(target, EngineConfig(max_batch=4), drafter, FixedDepth(budget))
    for _ in range(2):  # the second call drafts from the first's outputs too
        out = engine.generate(reqs)
        assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert out.stats.acceptance_length > 2  # history's tree, whichever the budget
    assert out.stats.draft_nodes > out.stats.draft_tokens  # trees
    assert CHAIN_UP_TO == 2 and kinds[:2] == (["chain", "tree"] if budget == 2 else ["tree"] * 2)
    assert ("chain" in kinds) == (budget == 2)


def _measured(chain_s: float | None) -> FormChoice:
    """A form choice told that at a budget of 1 the chain kept 1.36 tokens per row and
    the tree 1.19 (at 2: 1.5 and 1.3) over 100 rows, and — unless `chain_s` is None —
    that a chain proposal takes `chain_s` seconds, a tree's 0.5 ms and the rest of the
    iteration 28 ms."""
    forms = FormChoice()
    for kind, counts, seconds in (("chain", [36, 14], chain_s), ("tree", [19, 11], 0.0005)):
        form = forms.choose(2)  # each tried first while unmeasured
        assert (form == "chain") == (kind == "chain"), form
        forms.counted(100, counts)
        if chain_s is not None:
            forms.observe(FormReport(), seconds, 0.028)
    return forms


def test_the_small_budget_choice_is_per_second_not_per_token(target):
    """The chain keeps more tokens at a budget of 1, but its network forwards make its
    iterations dearer than the history tree's: per second the tree wins (on a CPU the
    chain's forwards cost a sixth of an iteration here), and the chain again once its
    proposals are cheap. Timed by the engine's iterations too, and checkpointed."""
    assert _measured(chain_s=None).choose(1) == "chain"  # untimed: tokens per row alone
    assert _measured(chain_s=0.008).choose(1) != "chain"  # 1.36 / 36 ms < 1.19 / 28.5 ms
    assert _measured(chain_s=0.002).choose(1) == "chain"  # 1.36 / 30 ms > 1.19 / 28.5 ms
    reqs = [
        Request(PROMPT, SamplingParams(1.0, max_new_tokens=24, stop_token_ids=(), seed=i))
        for i in range(4)
    ]
    depth = FixedDepth(2)
    Engine(target, EngineConfig(max_batch=4), _combined(target), depth).generate(reqs)
    timed = depth.forms.state_dict()["small_s"]
    assert set(timed) == {"chain", "tree", "rest"} and all(v > 0 for v in timed.values())
    restored = FormChoice()
    restored.load_state_dict(depth.forms.state_dict())
    assert restored.state_dict() == depth.forms.state_dict()


def test_the_network_is_charged_its_steady_feed_not_a_catch_up(target):
    """The network is fed lazily: after iterations that skipped it, one forward runs
    every pair since. That one-off is not what the network costs when used, so it is
    charged what feeding one iteration's pairs costs — measured in a generate that fed
    it every iteration — and a feed is charged as it came only before any such."""
    reqs = [
        Request(PROMPT, SamplingParams(1.0, max_new_tokens=24, stop_token_ids=(), seed=i))
        for i in range(4)
    ]
    depth = FixedDepth(2)
    Engine(target, EngineConfig(max_batch=4), _combined(target), depth).generate(reqs)
    assert depth.forms.state_dict()["feed_s"] > 0  # the engine's steady feeds were timed

    def network_cost(forms: FormChoice, feed: float, steady: bool) -> float:
        """The network's cost `forms` records for a merged tree fed in `feed` seconds
        (4 ms more on candidates), from a fresh cost figure."""
        forms.cost = 0.0
        forms.choose(8)
        forms.observe(FormReport(feed=feed, steady=steady, network=feed + 0.004), 0.01, 0.02)
        return forms.cost

    forms = FormChoice()
    assert network_cost(forms, 0.05, steady=False) == pytest.approx(0.054)  # as it came
    assert network_cost(forms, 0.001, steady=True) == pytest.approx(0.005)
    assert network_cost(forms, 0.05, steady=False) == pytest.approx(0.005)  # steady's price


def test_a_checkpoint_keeps_the_forms_figures_with_the_drafters_state(target):
    """A run's drafter state (what `state.pt` saves) holds the depth policy's figures of
    the forms beside the history, and restoring it — or a state saved before the forms
    moved out of the combined drafter, which held them itself — restores both."""
    from specroll.rl.rollout.local import LocalRollout

    reqs = [
        Request(PROMPT, SamplingParams(1.0, max_new_tokens=24, stop_token_ids=(), seed=i))
        for i in range(4)
    ]

    def rollout() -> LocalRollout:
        return LocalRollout(
            Engine(target, EngineConfig(max_batch=4), _combined(target), FixedDepth(2))
        )

    run = rollout()
    run.generate(reqs)
    state = run.drafter_state()
    assert state["forms"]["feed_s"] > 0 and state["history"]
    for saved in (state, {k: v for k, v in state.items() if k != "forms"} | state["forms"]):
        resumed = rollout()
        resumed.load_drafter_state(saved)
        again = resumed.drafter_state()
        for key in ("forms", "taken", "predicted"):
            assert again[key] == state[key], key
        assert again["history"].keys() == state["history"].keys()


def test_the_combined_drafter_picks_the_source_that_predicts(target):
    """A history holding plain decoding's own continuations (greedy) outweighs a random
    draft network: the trees are history's and accepted whole; with no history they are
    the draft's."""
    reqs = [
        Request(PROMPT, SamplingParams(0.0, max_new_tokens=32, stop_token_ids=(), seed=i))
        for i in range(2)
    ]
    greedy = Engine(target, EngineConfig(max_batch=2)).generate(reqs)
    knows = HistoryDrafter(sources=("past",))
    knows.remember(PROMPT, greedy[0].token_ids)
    empty = HistoryDrafter(sources=("past",))
    for history, source in ((knows, "history"), (empty, "draft")):
        history.learn = False
        drafter = _combined(target, history)
        engine = Engine(target, EngineConfig(max_batch=2), drafter, FixedDepth(8))
        engine.generate(reqs)
        other = "draft" if source == "history" else "history"
        # the walk reached candidates of the source that predicts only
        assert drafter.predicted[source] > 0 and drafter.predicted[other] == 0
        if source == "history":  # and took them: whole trees accepted
            assert drafter.taken[source] > 0 and engine.stats.acceptance_length > 4
    assert drafter.calibration("draft") < 1  # the random head's misses were counted


def test_a_verified_tree_tells_what_every_smaller_budget_emits():
    """Truncating a best-first tree to its first m nodes changes the walk only where it
    would go through node m or later: with the same uniforms it accepts exactly the
    accepted path's nodes numbered below m (what adaptive tree size counts)."""
    g = torch.Generator().manual_seed(5)
    n, N = 4000, 12
    logits = torch.randn(N, VOCAB, generator=g) * 2.0  # per node: the target's logits
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 8])  # parents first
    tokens = torch.randint(0, VOCAB, (n, N), generator=g)
    u = torch.rand(n, 6, generator=g, dtype=torch.float64)
    rows = RowSampling.full(n, 1.0, 0, 1.0)
    anc = tree.ancestors(parents.expand(n, -1))
    depth = int(tree.depths(anc).max())

    def walk(m: int):
        par = parents.expand(n, -1).clone()
        par[:, m + 1 :] = -1  # keep nodes 1..m (and the root)
        return tree.verify_tree(lambda r, nodes: logits[nodes], tokens, par, depth, rows, u)

    full = walk(N - 1)
    for m in (0, 1, 3, 6, 9):
        cut = walk(m)
        path = full.path.masked_fill(torch.arange(depth + 1) > full.num_accepted[:, None], 0)
        expect = ((path >= 1) & (path <= m)).sum(1)
        assert torch.equal(cut.num_accepted, expect), m
        # and what it emits is the full walk's tokens up to there, then the same draw
        for i in range(0, n, 97):
            a = int(expect[i])
            assert cut.tokens[i, : a + 1].tolist() == full.tokens[i, : a + 1].tolist()


def test_adaptive_tree_size_estimates_tokens_from_node_hits():
    cost = CostModel(fixed=1e-3, per_token=1e-4, knee=1.0)
    policy = AdaptiveDepth(cost, k_max=64, tree=True)
    assert policy.sizes == [0, 1, 2, 4, 8, 16, 32, 64]
    for _ in range(400):  # node 0 always on the path, node 1 half the time, the rest never
        policy.observe_counts(10, [10, 5] + [0] * 62)
    assert policy.expected_tokens(1) == pytest.approx(2.0, abs=0.02)
    assert policy.expected_tokens(2) == pytest.approx(2.5, abs=0.02)
    assert policy.expected_tokens(64) == pytest.approx(2.5, abs=0.05)
    # forwards cost per token here: the extra nodes buy nothing, so a small tree wins
    assert policy.best(1) == 2
    # a useless drafter: plain decoding
    useless = AdaptiveDepth(cost, k_max=64, tree=True)
    for _ in range(400):
        useless.observe_counts(10, [0] * 64)
    assert useless.best(1) == 0


def test_a_big_trees_node_hits_predict_a_smaller_budgets_tokens(target):
    """The same requests (history held fixed) at a budget of 16 and of 4: what the big
    trees' node hits say 4 nodes would emit per row-iteration is what 4 nodes do."""
    t = 1.0
    history = HistoryDrafter(sources=("prompt", "past"))
    for out in _outputs(target, 16, t, seed0=5, tokens=24):
        history.remember(PROMPT, out)
    history.learn = False
    reqs = [
        Request(PROMPT, SamplingParams(t, max_new_tokens=24, stop_token_ids=(), seed=100 + i))
        for i in range(400)
    ]
    big = Engine(target, EngineConfig(max_batch=400), history, FixedDepth(16))
    big.generate(reqs)
    small = Engine(target, EngineConfig(max_batch=400), history, FixedDepth(4))
    small.generate(reqs)
    predicted, measured = big.stats.tau_at(4), small.stats.tokens_per_target_forward
    assert big.stats.tau_at(16) > predicted > 1.2
    assert predicted == pytest.approx(measured, rel=0.03), (predicted, measured)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [2, 16])
def test_joint_distribution_with_the_combined_drafter_learning(target, budget):
    """History learning as rows finish, a random-init head; a budget of 2 drafts the
    head's sampled chain (q-ratio test) and trees (the depth policy measures both), 16
    the merged tree only: the law is the target's."""
    t, k, p = 0.7, 0, 1.0
    drafter = _combined(target)
    kinds = _kinds(drafter)
    engine = Engine(target, EngineConfig(max_batch=512), drafter, FixedDepth(budget))
    counts = sample_joint(engine, JOINT_SAMPLES, t, k, p, mixed=True)
    assert engine.stats.accepted_tokens > 0
    assert "tree" in kinds and ("chain" in kinds) == (budget == 2)
    exact = exact_joint(target, t, k, p)
    assert chi2_pvalue(counts, exact) > 1e-4
    assert chi2_pvalue(counts, tv_shifted(exact, 0.02)) < 1e-4


def test_the_network_is_skipped_while_it_brings_less_than_it_costs(target):
    """A random head beside a history that knows plain decoding's continuations (greedy)
    brings nothing the history does not: after its first iterations it runs only to be
    measured again (every `PROBE_EVERY`). A head that proposes those very continuations
    beside an empty history brings every accepted token and runs every iteration."""
    reqs = [
        Request(PROMPT, SamplingParams(0.0, max_new_tokens=64, stop_token_ids=(), seed=i))
        for i in range(2)
    ]
    greedy = Engine(target, EngineConfig(max_batch=2)).generate(reqs)[0].token_ids
    for knows in (True, False):
        history = HistoryDrafter(sources=("past",))
        if knows:
            history.remember(PROMPT, greedy)
        history.learn = False
        drafter = _combined(target, history)
        calls = []
        candidates = drafter.draft.candidates

        def perfect(batch, depth, width, candidates=candidates):  # plain's own, q = 1
            toks, probs = candidates(batch, depth, width)
            at = (batch.n_gen.unsqueeze(1) + torch.arange(depth)).clamp(max=len(greedy) - 1)
            toks[:, :, 0] = torch.tensor(greedy)[at]
            probs[:, :, 0], probs[:, :, 1:] = 1.0, 0.0
            return toks, probs

        def counted(batch, depth, width, knows=knows, calls=calls, candidates=candidates):
            calls.append(1)
            return candidates(batch, depth, width) if knows else perfect(batch, depth, width)

        drafter.draft.candidates = counted
        engine = Engine(target, EngineConfig(max_batch=2), drafter, FixedDepth(8))
        engine.generate(reqs)
        iterations = engine.stats.target_forwards
        if knows:
            assert len(calls) <= 2 + iterations // PROBE_EVERY, (calls, iterations)
        else:
            assert len(calls) == iterations and engine.stats.acceptance_length > 4


def test_plain_iterations_teach_the_drafter_nothing(target):
    """An iteration the depth policy left plain (no proposal) is not evidence about the
    last proposal: calibration and the chain/tree measurements stay as they were."""
    reqs = [
        Request(PROMPT, SamplingParams(1.0, max_new_tokens=24, stop_token_ids=(), seed=i))
        for i in range(4)
    ]
    drafter, depth = _combined(target), FixedDepth(8)
    Engine(target, EngineConfig(max_batch=4), drafter, depth).generate(reqs)
    before = drafter.state_dict() | depth.forms.state_dict()
    assert drafter.predicted["history"] > 0
    plain = FixedDepth(0)
    plain.forms = depth.forms
    Engine(target, EngineConfig(max_batch=4), drafter, plain).generate(reqs)
    after = drafter.state_dict() | depth.forms.state_dict()
    for key in ("taken", "predicted", "small"):
        assert after[key] == before[key], key
