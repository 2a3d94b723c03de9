"""Draft trees and the history drafter are exactly plain decoding.

* the tree verifier's one-step law, analytically checkable: duplicates, zero-probability
  and truncated candidates never move the output off p;
* chi-square of the joint distribution of three tokens through the engine (the suite's
  method and thresholds) for random trees of 4, 16 and 64 nodes and for the history
  drafter, at temperatures, top-k and top-p;
* the conditional case: history held fixed, fresh seeds, output law = the target's; a
  control that replays an old sample with its q-ratio (SPEC-RL-like reuse) fails it;
* deep trees (a planted path at depth <= 8 among decoys) give the very tokens plain
  decoding gives with the same seeds, and greedy is token-identical.
"""

from __future__ import annotations

import pytest
import torch

from specroll.drafters.base import Drafter, Proposal
from specroll.drafters.history import HistoryConfig, HistoryDrafter, tree_from
from specroll.drafters.suffix_index import SuffixIndex
from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine.depth import FixedDepth
from specroll.spec import tree
from specroll.spec.sampling import RowSampling, probs_from_logits
from tests.conftest import (
    JOINT_SAMPLES,
    PROMPT,
    VOCAB,
    chi2_pvalue,
    exact_joint,
    gof_pvalue,
    related_draft,
    sample_joint,
    spec_model,
    tv_shifted,
)

N = JOINT_SAMPLES
SETTINGS = [(0.7, 0, 1.0), (1.0, 0, 1.0), (1.0, 6, 1.0), (1.0, 0, 0.85)]


@pytest.fixture(scope="module")
def target():
    return spec_model(0)


class RandomTree(Drafter):
    """Random trees of `k` nodes: chains and bushes, duplicate siblings, tokens of any
    probability (zero under top-k / top-p included); a node budget filled or not."""

    name = "random-tree"
    tree = True

    def __init__(self, seed: int = 0) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, batch) -> Proposal:
        B, k, g = batch.last.shape[0], batch.k, self.g
        parents = torch.stack([torch.randint(0, j + 1, (B,), generator=g) for j in range(k)], 1)
        chain = torch.arange(k).expand(B, k)
        parents = torch.where(torch.rand(B, k, generator=g) < 0.5, chain, parents)
        tokens = torch.randint(0, VOCAB, (B, k), generator=g)
        dup = torch.rand(B, k, generator=g) < 0.2  # repeat the previous node's token
        tokens[:, 1:] = torch.where(dup[:, 1:], tokens[:, :-1], tokens[:, 1:])
        lengths = torch.randint(0, k + 1, (B,), generator=g)
        dev = batch.last.device
        return Proposal(tokens.to(dev), None, lengths.to(dev), parents.to(dev))


# ------------------------------------------------------------------ pure functions


def test_ancestors_depths_and_chains():
    #        0
    #      1   2
    #     3 4    5
    #              6
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 5, -1]])
    anc = tree.ancestors(parents)
    assert tree.depths(anc).tolist() == [[0, 1, 1, 2, 2, 2, 3, 0]]
    assert anc[0, 6].nonzero().flatten().tolist() == [0, 2, 5, 6]
    assert anc[0, 7].nonzero().flatten().tolist() == [7]  # an unused node sees itself only
    chain = torch.cat([torch.full((2, 1), -1), tree.chain_parents(2, 5)], 1)
    assert tree.depths(tree.ancestors(chain)).tolist() == [list(range(6))] * 2


@pytest.mark.parametrize("t,k,p", SETTINGS)
def test_one_step_of_the_tree_verifier_emits_exactly_p(t, k, p):
    """Root with candidates: two likely tokens, a duplicate, a zero-probability one (outside
    top-k/top-p when on): every emitted token is distributed as p, 200k draws."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, VOCAB, generator=g) * 2
    s = RowSampling.full(1, t, k, p)
    probs = probs_from_logits(logits, s)[0]
    order = probs.argsort(descending=True).tolist()
    children = [order[0], order[1], order[0], order[-1]]
    n = 200_000
    tokens = torch.tensor([[0, *children]]).expand(n, -1)
    parents = torch.tensor([[-1, 0, 0, 0, 0]]).expand(n, -1)
    u = torch.rand(n, 2, generator=g, dtype=torch.float64)
    out = tree.verify_tree(
        lambda r, nodes: logits.expand(len(r), -1),
        tokens,
        parents,
        1,
        RowSampling.full(n, t, k, p),
        u,
    )
    first = out.tokens[:, 0]
    assert gof_pvalue(torch.bincount(first, minlength=VOCAB), probs.double()) > 1e-4
    # it descended exactly when the draw was a candidate, into the first of duplicates
    hit = torch.isin(first, torch.tensor(children))
    assert torch.equal(out.num_accepted.bool(), hit)
    assert set(out.path[hit, 1].tolist()) <= {1, 2, 4}


def test_tree_from_keeps_the_heaviest_nodes_parents_first():
    seqs = [[5, 1, 2, 3], [5, 1, 2, 4], [5, 1, 7, 7], [5, 9, 9, 9]]
    occ = [(s, 1, 1.0) for s in seqs]
    tokens, parents = tree_from(occ, nodes=4, depth=3, min_prob=0.0)
    assert tokens[:3] == [1, 2, 9] or tokens[:2] == [1, 2]
    assert all(p < i + 1 for i, p in enumerate(parents))  # parents come first
    assert tokens[0] == 1 and parents[0] == 0
    chain_t, chain_p = tree_from(occ, nodes=8, depth=3, min_prob=0.0, chain=True)
    assert chain_t == [1, 2, 3] and chain_p == [0, 1, 2]
    pruned, _ = tree_from(occ, nodes=8, depth=3, min_prob=0.5)
    assert pruned == [1, 2]  # 3/4 and 2/4 of the weight; nothing else reaches 1/2


def test_suffix_index_finds_latest_occurrences_and_forgets_dropped_ones():
    idx = SuffixIndex(n_max=3)
    idx.extend(1, [1, 2, 3, 1, 2, 4])
    idx.extend(2, [9, 1, 2, 5])
    found = idx.find((1, 2), limit=8)
    assert [(sid, s[nxt]) for sid, s, nxt in found] == [(2, 5), (1, 4), (1, 3)]
    idx.drop(2)
    assert [s[nxt] for _, s, nxt in idx.find((1, 2), limit=8)] == [4, 3]
    assert idx.find((1, 2), limit=8, skip={1}) == []


def test_history_config_names_the_field_and_the_allowed_values():
    with pytest.raises(ValueError, match="history.sources.*prompt, siblings, past, others"):
        HistoryConfig(sources=("past", "future"))
    with pytest.raises(ValueError, match="history.max_depth must be >= 1"):
        HistoryConfig(max_depth=0)
    with pytest.raises(ValueError, match=r"history.min_prob must be in \[0, 1\)"):
        HistoryConfig(min_prob=1.0)


# ------------------------------------------------------------------ through the engine


TREE_CASES = [  # nodes, (t, k, p): the settings once (64 nodes: the planted deep trees
    (4, SETTINGS[0]),  # below); the whole grid under -m slow
    (16, SETTINGS[2]),
    (16, SETTINGS[3]),
]
TREE_GRID = [
    pytest.param(n, s, marks=() if (n, s) in TREE_CASES else pytest.mark.slow)
    for n in (4, 16, 64)
    for s in SETTINGS
]


@pytest.mark.parametrize("nodes,setting", TREE_GRID)
def test_joint_distribution_with_random_trees_matches_plain_decoding(target, nodes, setting):
    t, k, p = setting
    engine = Engine(target, EngineConfig(max_batch=512), RandomTree(nodes), FixedDepth(nodes))
    counts = sample_joint(engine, N, t, k, p, mixed=True)
    s = engine.stats
    assert s.draft_nodes > N and 0.05 < s.acceptance_rate < 0.95  # both outcomes, often
    exact = exact_joint(target, t, k, p)
    assert chi2_pvalue(counts, exact) > 1e-4
    assert chi2_pvalue(counts, tv_shifted(exact, 0.02)) < 1e-4


def _old_outputs(target, n: int, t: float, k: int, p: float, seed0: int) -> list[list[int]]:
    engine = Engine(target, EngineConfig(max_batch=64))
    params = [
        SamplingParams(t, top_k=k, top_p=p, max_new_tokens=5, stop_token_ids=(), seed=seed0 + i)
        for i in range(n)
    ]
    return [r.token_ids for r in engine.generate([Request(PROMPT, q) for q in params])]


class FullFan(Drafter):
    """Every token of the vocabulary under the root, in a random order, then a random
    subtree: the first token is always accepted, through a child of any index."""

    name = "full-fan"
    tree = True

    def __init__(self, seed: int = 0) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, batch) -> Proposal:
        B, k, g = batch.last.shape[0], batch.k, self.g
        fan = torch.stack([torch.randperm(VOCAB, generator=g) for _ in range(B)])  # [B, V]
        rest = k - VOCAB
        deeper = torch.stack(
            [torch.randint(1, j + 1, (B,), generator=g) for j in range(VOCAB, k)], 1
        )
        tokens = torch.cat([fan, torch.randint(0, VOCAB, (B, rest), generator=g)], 1)
        parents = torch.cat([torch.zeros(B, VOCAB, dtype=torch.long), deeper], 1)
        dev = batch.last.device
        return Proposal(tokens=tokens.to(dev), probs=None, parents=parents.to(dev))


@pytest.mark.parametrize("broken", [False, True])
def test_a_full_fan_is_exact_and_a_tree_mask_that_leaks_siblings_fails(target, monkeypatch, broken):
    """Every first token is a candidate (acceptance 1 at depth 1). With `broken`, tree
    nodes also see the nodes before them (a causal mask, as for a chain) while keeping
    their positions: deep tokens are drawn in the wrong context, and the same
    chi-square test rejects it."""
    from specroll.model import transformer

    if broken:
        layout = transformer.attention_layout

        def leaky(cfg, tokens, positions, cache, slot_start=0, max_start=None, tree=None):
            pos, mask, n = layout(cfg, tokens, positions, cache, slot_start, max_start, tree)
            if tree is not None:
                _, n_tree = tokens.shape
                causal = torch.ones(n_tree, n_tree, dtype=torch.bool).tril()
                pos2, mask, n = layout(
                    cfg, tokens, positions, cache, slot_start, max_start, causal.expand_as(tree)
                )
            return pos, mask, n

        monkeypatch.setattr(transformer, "attention_layout", leaky)
    engine = Engine(target, EngineConfig(max_batch=512), FullFan(), FixedDepth(32))
    # the leak is gross (p underflows to 0 at 6k samples): a fifth of the samples rejects it
    counts = sample_joint(engine, N // 5 if broken else N, 1.0, 0, 1.0, mixed=False)
    assert engine.stats.per_position[0] == 1.0
    exact = exact_joint(target, 1.0, 0, 1.0)
    if broken:
        assert chi2_pvalue(counts, exact) < 1e-6
    else:
        assert chi2_pvalue(counts, exact) > 1e-4
        assert chi2_pvalue(counts, tv_shifted(exact, 0.02)) < 1e-4


HISTORY_GRID = [pytest.param(*s, marks=pytest.mark.slow) for s in SETTINGS[1:]]


@pytest.mark.parametrize("t,k,p", [SETTINGS[0], *HISTORY_GRID])
def test_joint_distribution_with_the_history_drafter_matches_plain_decoding(target, t, k, p):
    """Every source on: the prompt, 512 live siblings, past rollouts (which grow as rows
    finish), a tree of 16 nodes."""
    drafter = HistoryDrafter(HistoryConfig(past=64))
    for out in _old_outputs(target, 32, t, k, p, seed0=10**6):
        drafter.remember(PROMPT, out)
    engine = Engine(target, EngineConfig(max_batch=512), drafter, FixedDepth(16))
    counts = sample_joint(engine, N, t, k, p, mixed=True)
    assert engine.stats.accepted_tokens > N // 4  # history candidates are taken, often
    exact = exact_joint(target, t, k, p)
    assert chi2_pvalue(counts, exact) > 1e-4
    assert chi2_pvalue(counts, tv_shifted(exact, 0.02)) < 1e-4


class ReplayDrafter(Drafter):
    """The control: replays one old response, proposing its tokens with q = the
    distribution they were sampled from (an older policy), for the q-ratio test. Each
    token keeps its marginal law, but the new rollout becomes a function of the old
    one's randomness."""

    name = "replay"

    def __init__(self, old: list[int], q: torch.Tensor) -> None:
        self.old, self.q = torch.tensor(old), q  # q: [len(old), V], q[j] at output j

    def propose(self, batch) -> Proposal:
        B, k = batch.last.shape[0], batch.k
        n = batch.n_gen  # [B] tokens generated; the row's `last` is output n - 1
        j = (n.unsqueeze(1) + torch.arange(k)).clamp(max=len(self.old) - 1)  # [B, k]
        hist = batch.history[:B]
        start = batch.pos - n + 1  # where the output starts in the history
        col = (start.unsqueeze(1) + torch.arange(len(self.old))).clamp(max=hist.shape[1] - 1)
        made = hist.gather(1, col)  # [B, len(old)] the row's output so far (and beyond)
        same = (made == self.old).long().cumprod(1).sum(1) >= n  # its output = old's so far
        lengths = torch.where(same, (len(self.old) - n).clamp(min=0, max=k), 0)
        return Proposal(tokens=self.old[j], probs=self.q[j], lengths=lengths)


def test_conditional_law_with_the_history_held_fixed_and_the_replay_control_fails(target):
    """The history (8 old rollouts) is held fixed; 30k fresh seeds. The history drafter's
    output law is the target's; replaying one old rollout with its q-ratio is not."""
    t, k, p = 1.0, 0, 1.0
    drafter = HistoryDrafter(HistoryConfig(sources=("prompt", "past")))
    olds = _old_outputs(target, 8, t, k, p, seed0=77)
    for out in olds:
        drafter.remember(PROMPT, out)
    drafter.learn = False  # finished rows do not join it: the history stays fixed
    engine = Engine(target, EngineConfig(max_batch=512), drafter, FixedDepth(16))
    counts = sample_joint(engine, N, t, k, p, mixed=False)
    assert engine.stats.accepted_tokens > N // 4
    exact = exact_joint(target, t, k, p)
    assert chi2_pvalue(counts, exact) > 1e-4

    # the control: an older policy's sample, replayed with q = that policy
    old_policy = related_draft(target, noise=0.3)
    old = olds[0]
    with torch.no_grad():
        logits = old_policy(torch.tensor([PROMPT + old])).logits[0, len(PROMPT) - 1 :]
    q = probs_from_logits(logits, RowSampling.full(len(logits), t, k, p))  # [len+1, V]
    replay = Engine(target, EngineConfig(max_batch=512), ReplayDrafter(old, q[:-1]), FixedDepth(3))
    n = N // 5  # the bias is gross (p underflows to 0 at 6k samples, 7 % against 0.3 %)
    replayed = sample_joint(replay, n, t, k, p, mixed=False)
    assert chi2_pvalue(replayed, exact) < 1e-6
    i = old[0] * VOCAB**2 + old[1] * VOCAB + old[2]
    assert replayed[i] / n > exact[i] + 0.02  # biased towards the old rollout


class PlantedPath(Drafter):
    """Plain decoding's own continuation planted at a random branch of a bushy tree of
    decoys: deep acceptances through every depth up to `depth`."""

    name = "planted"
    tree = True

    def __init__(self, outputs: dict[int, list[int]], depth: int, seed: int = 0) -> None:
        self.outputs, self.depth = outputs, depth
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, batch) -> Proposal:
        B, k = batch.last.shape[0], batch.k
        tokens = torch.randint(0, VOCAB, (B, k), generator=self.g)
        parents = torch.stack(
            [torch.randint(0, j + 1, (B,), generator=self.g) for j in range(k)], 1
        )
        seeds, n_gen = batch.seed.tolist(), batch.n_gen.tolist()
        for b in range(B):
            true = self.outputs[seeds[b]][n_gen[b] : n_gen[b] + self.depth]
            slots = sorted(torch.randperm(k, generator=self.g)[: len(true)].tolist())
            prev = 0
            for tok, j in zip(true, slots, strict=False):
                tokens[b, j], parents[b, j] = tok, prev
                prev = j + 1
        return Proposal(tokens=tokens, probs=None, parents=parents)


@pytest.mark.parametrize("nodes,depth", [(16, 4), (64, 8)])
def test_deep_trees_give_plain_decodings_own_tokens(target, nodes, depth):
    """Sampling (T = 1, top-p 0.9) with the same seeds: the tree engine emits the tokens
    plain decoding emits, through accepted paths of every depth up to 8."""
    params = [
        SamplingParams(1.0, top_p=0.9, max_new_tokens=64, stop_token_ids=(), seed=s)
        for s in range(32)
    ]
    reqs = [Request(PROMPT, q) for q in params]
    plain = Engine(target, EngineConfig(max_batch=32)).generate(reqs)
    outputs = {r.seed: r.token_ids for r in plain}
    engine = Engine(
        target, EngineConfig(max_batch=32), PlantedPath(outputs, depth), FixedDepth(nodes)
    )
    spec = engine.generate(reqs)
    same = sum(a.token_ids == b.token_ids for a, b in zip(plain, spec, strict=True))
    assert same >= 31  # fp32 logits of a tree forward differ from plain's by rounding only
    pairs = zip(plain, spec, strict=True)
    lp = max(abs(x - y) for a, b in pairs for x, y in zip(a.logprobs, b.logprobs, strict=True))
    assert lp < 1e-3
    assert engine.stats.per_position[depth - 1] > 0.3  # the deepest level is reached
    assert engine.stats.acceptance_length > depth / 2


def test_greedy_history_trees_are_token_identical_to_plain(target):
    params = SamplingParams(0.0, max_new_tokens=96, stop_token_ids=())
    reqs = [Request(PROMPT, params), Request(PROMPT[:5], params), Request([1, 2, 3], params)]
    plain = Engine(target, EngineConfig(max_batch=4)).generate(reqs)
    drafter = HistoryDrafter()
    engine = Engine(target, EngineConfig(max_batch=4), drafter, FixedDepth(16))
    for _ in range(2):  # the second time, the first call's outputs are history
        spec = engine.generate(reqs)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert engine.stats.acceptance_length > 4  # greedy repeats itself: history has it all


def test_the_walk_along_the_engines_samples_is_the_engines_run(target):
    """`engine.walk` predicts acceptance without a forward; along the engine's own
    samples it is the engine's run, iteration for iteration (groups of 8 siblings, a
    remembered past, rows finishing at different times)."""
    from specroll.engine.walk import walk

    def drafter() -> HistoryDrafter:
        d = HistoryDrafter(HistoryConfig(past=8))
        for out in _old_outputs(target, 8, 1.0, 0, 1.0, seed0=5):
            d.remember(PROMPT, out)
        return d

    reqs = [
        Request(
            PROMPT[: 4 + i % 3],
            SamplingParams(1.0, max_new_tokens=20 + i, stop_token_ids=(7,), seed=i),
        )
        for i in range(16)
    ]
    engine = Engine(target, EngineConfig(max_batch=16), drafter(), FixedDepth(16))
    out = engine.generate(reqs)
    s = out.stats
    assert s.accepted_tokens > 0 and min(len(r.token_ids) for r in out) < 20  # stops happen
    budgets = [q.params.max_new_tokens for q in reqs]
    w = walk(drafter(), [r.prompt_ids for r in out], [r.token_ids for r in out], 16, budgets)
    assert (w.row_forwards, w.emitted, w.accepted) == (
        s.row_forwards,
        s.emitted_tokens,
        s.accepted_tokens,
    )


def test_the_history_keeps_a_bounded_number_of_prompts_and_rollouts():
    d = HistoryDrafter(HistoryConfig(past=2, prompts=3, window=4))
    for p in range(5):
        for r in range(3):
            d.remember([100 + p, 1, 2], [p, r, 7, 7])
    assert list(d.prompts) == [(102, 1, 2), (103, 1, 2), (104, 1, 2)]  # least recent out
    assert all(len(q.done) == 2 for q in d.prompts.values())
    assert len(d.recent) == 4 and len(d.others.seqs) == 4
    last = d.prompts[(104, 1, 2)]
    found = last.index.find((2, 4), limit=8)  # the prompt's end and the first token
    assert sorted(s[n] for _, s, n in found) == [1, 2]  # its last two rollouts (r = 1, 2)
