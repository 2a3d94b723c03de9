"""Draft trees and the history drafter are exactly plain decoding.

A tree's candidates are deterministic and each output index draws with the row's own
uniform, so a tree engine emits the very tokens plain decoding emits with the same seeds.
That is tested directly, token for token, over hundreds of seeds:

* the tree verifier's one step, a pure function: its first token is plain decoding's
  draw for every uniform, whatever the candidates (duplicates, zero-probability and
  truncated ones), and it descends exactly when that draw is a candidate;
* through the engine, random trees of 4, 16 and 64 nodes, a full fan, deep trees with a
  planted path, and the history drafter (every source live, or its history held fixed
  under fresh seeds: the conditional law), at temperatures, top-k and top-p: every
  request's tokens equal plain decoding's; a difference is accepted only as a rounding
  flip (the uniform within 1e-5 of the CDF boundary between the two tokens under both
  forwards' distributions), and a tree mask that leaks siblings fails that check;
* one chi-square of the joint law of three tokens (random trees, the suite's method) for
  the tree family end to end; the rest of the grid runs under -m slow;
* the control for reuse: replaying an old sample with its q-ratio (SPEC-RL-like) keeps
  each token's marginal and breaks the conditional law, which a chi-square rejects;
* greedy history trees are token-identical to plain decoding.
"""

from __future__ import annotations

import pytest
import torch

from specroll.drafters import history as history_module
from specroll.drafters.base import Drafter, Proposal
from specroll.drafters.candidate_tree import tree_from
from specroll.drafters.history import HistoryDrafter
from specroll.drafters.suffix_index import SuffixIndex
from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine.depth import FixedDepth
from specroll.spec import rng, tree
from specroll.spec import verify as chain_verify
from specroll.spec.sampling import RowSampling, probs_from_logits
from tests.conftest import (
    JOINT_SAMPLES,
    PROMPT,
    VOCAB,
    chi2_pvalue,
    exact_joint,
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
def test_one_step_of_the_tree_verifier_draws_plain_decodings_token(t, k, p):
    """Root with candidates: two likely tokens, a duplicate, a zero-probability one (outside
    top-k/top-p when on). For 4096 uniforms and the midpoint of every CDF interval, the
    first emitted token is plain decoding's draw with that uniform (so it is distributed
    as p, exactly), and the walk descends exactly when that draw is a candidate, into
    the first of duplicates."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, VOCAB, generator=g) * 2
    probs = probs_from_logits(logits, RowSampling.full(1, t, k, p))[0]
    order = probs.argsort(descending=True).tolist()
    children = [order[0], order[1], order[0], order[-1]]
    cdf = probs.double().cumsum(0) / probs.double().sum()
    mids = ((torch.cat([torch.zeros(1, dtype=torch.float64), cdf[:-1]]) + cdf) / 2)[probs > 0]
    u0 = torch.cat([torch.rand(4096, generator=g, dtype=torch.float64), mids])
    n = len(u0)
    tokens = torch.tensor([[0, *children]]).expand(n, -1)
    parents = torch.tensor([[-1, 0, 0, 0, 0]]).expand(n, -1)
    u = torch.stack([u0, torch.rand(n, generator=g, dtype=torch.float64)], 1)
    out = tree.verify_tree(
        lambda r, nodes: logits.expand(len(r), -1),
        tokens,
        parents,
        1,
        RowSampling.full(n, t, k, p),
        u,
    )
    first = out.tokens[:, 0]
    plain = chain_verify.verify(  # plain decoding: the chain verifier with no draft
        logits.expand(n, 1, -1),
        torch.zeros(n, 0, dtype=torch.long),
        torch.zeros(n, dtype=torch.long),
        None,
        RowSampling.full(n, t, k, p),
        torch.zeros(n, 0, dtype=torch.float64),
        u0.unsqueeze(1),
    )
    assert torch.equal(first, plain.tokens[:, 0])
    assert first[-len(mids) :].tolist() == probs.nonzero().flatten().tolist()  # each token
    hit = torch.isin(first, torch.tensor(children))
    assert torch.equal(out.num_accepted.bool(), hit)
    assert set(out.path[hit, 1].tolist()) <= {1, 2, 4}
    assert 0 < hit.float().mean() < 1


@pytest.mark.parametrize("t,k,p", SETTINGS)
def test_the_masked_walk_draws_what_the_host_paced_walk_draws(t, k, p):
    """Random trees (bushes, chains, duplicate siblings, unused nodes) over random node
    logits: the masked walk over every node (no host read, a depth bound past the
    deepest node) emits the same tokens, log-probs, path and acceptances as the walk the
    host paces, bit for bit; past a row's stop it emits nothing."""
    g = torch.Generator().manual_seed(3)
    n, N = 512, 12
    logits = torch.randn(n, N, VOCAB, generator=g) * 2
    parents = torch.stack([torch.randint(-1, j, (n,), generator=g) for j in range(N)], 1)
    parents[:, 0] = -1
    parents[:, 1] = 0  # every tree has a first candidate
    tokens = torch.randint(0, VOCAB, (n, N), generator=g)
    dup = torch.rand(n, N - 2, generator=g) < 0.3  # repeat the previous node's token
    tokens[:, 2:] = torch.where(dup, tokens[:, 1:-1], tokens[:, 2:])
    depth = int(tree.depths(tree.ancestors(parents)).max())
    rows = RowSampling.full(n, t, k, p)
    bound = N - 1
    u = torch.rand(n, bound + 1, generator=g, dtype=torch.float64)
    paced = tree.verify_tree(lambda r, nodes: logits[r, nodes], tokens, parents, depth, rows, u)
    masked = tree.verify_tree_masked(logits, tokens, parents, bound, rows, u)
    assert torch.equal(masked.num_accepted, paced.num_accepted)
    assert paced.num_accepted.max() >= 2  # walks went deep
    D1 = depth + 1
    for name in ("tokens", "logprobs", "path"):
        assert torch.equal(getattr(masked, name)[:, :D1], getattr(paced, name)), name
    assert torch.equal(masked.accepted[:, :depth], paced.accepted)
    assert not masked.accepted[:, depth:].any() and (masked.tokens[:, D1:] == -1).all()


def test_the_masked_walk_in_the_engine_gives_plain_decodings_tokens(target, monkeypatch):
    """The engine's tree step as an accelerator runs it (one LM head over every node, the
    masked walk to the node budget, no read-back in the walk), here on the CPU: plain
    decoding's tokens for every request, as the host-paced walk gives them."""
    from specroll import device

    monkeypatch.setattr(device, "HOST_PACED", ())
    engine = Engine(target, EngineConfig(max_batch=N_DET), RandomTree(1), FixedDepth(16))
    _assert_plain_tokens(target, engine, _requests(*SETTINGS[3], N_DET, 16), monkeypatch)
    assert engine.stats.accepted_tokens > N_DET // 2


def test_tree_from_keeps_the_heaviest_nodes_parents_first():
    seqs = [[5, 1, 2, 3], [5, 1, 2, 4], [5, 1, 7, 7], [5, 9, 9, 9]]
    occ = [(s, 1, 1.0) for s in seqs]
    tokens, parents = tree_from(occ, nodes=4, depth=3)
    assert tokens[:3] == [1, 2, 9] or tokens[:2] == [1, 2]
    assert all(p < i + 1 for i, p in enumerate(parents))  # parents come first
    assert tokens[0] == 1 and parents[0] == 0
    chain_t, chain_p = tree_from(occ, nodes=8, depth=3, chain=True)
    assert chain_t == [1, 2, 3] and chain_p == [0, 1, 2]


def test_suffix_index_finds_latest_occurrences_and_forgets_dropped_ones():
    idx = SuffixIndex(n_max=3)
    idx.extend(1, [1, 2, 3, 1, 2, 4])
    idx.extend(2, [9, 1, 2, 5])
    found = idx.find((1, 2), limit=8)
    assert [(sid, s[nxt]) for sid, s, nxt in found] == [(2, 5), (1, 4), (1, 3)]
    idx.drop(2)
    assert [s[nxt] for _, s, nxt in idx.find((1, 2), limit=8)] == [4, 3]
    assert idx.find((1, 2), limit=8, skip={1}) == []


def test_history_sources_name_the_allowed_values():
    with pytest.raises(ValueError, match="history sources.*prompt, siblings, past, others"):
        HistoryDrafter(sources=("past", "future"))


# ------------------------------------------------------------------ through the engine


FLIP_TOL = 1e-5
"""How close to a CDF boundary the uniform of a differing token must be, under both
forwards' distributions: fp32 logits of a batched tree forward and of a plain forward
differ by rounding (~1e-7 in probability), nowhere near this."""


def _record_draws(monkeypatch) -> list:
    """Every draw the verifiers make from here on, appended as (probs float64 [n, V],
    u [n], ids [n]): the chain verifier's (plain decoding and prefill are its k = 0
    case) and the tree walk's."""
    book: list = []
    for mod in (chain_verify, tree):
        draw = mod.sample_from_probs

        def recorded(probs, u, draw=draw):
            ids = draw(probs, u)
            book.append((probs.detach().double().cpu(), u.detach().cpu(), ids.detach().cpu()))
            return ids

        monkeypatch.setattr(mod, "sample_from_probs", recorded)
    return book


def _draw_at(book: list, u: float) -> tuple[torch.Tensor, int]:
    """(the distribution inverted, the token drawn) by the draw that used uniform u."""
    for probs, us, ids in book:
        hit = (us == u).nonzero()
        if len(hit):
            i = int(hit[0, 0])
            return probs[i], int(ids[i])
    raise AssertionError(f"no draw used u = {u}: the engines do not share their uniforms")


def _boundary_distance(probs: torch.Tensor, u: float, a: int, b: int) -> float:
    """How far u is from the CDF boundary between tokens a and b under `probs` (the
    sampler's CDF, scaled by its own total): 0 when they are neighbours in the CDF and u
    sits on their boundary; the mass between them counts against it."""
    lo, hi = sorted((a, b))
    cdf = probs.cumsum(0) / probs.sum()
    return max(abs(u - cdf[lo].item()), abs(u - cdf[hi - 1].item()))


def _divergences(reqs, plain, spec, plain_book, spec_book) -> list[tuple[int, int, float]]:
    """(request, first differing index, boundary distance) for every request whose tokens
    differ from plain decoding's; the distance is the larger under the two forwards."""
    out = []
    for r, (q, a, b) in enumerate(zip(reqs, plain, spec, strict=True)):
        x, y = a.token_ids, b.token_ids
        if x == y:
            continue
        assert len(x) == len(y), (r, x, y)  # no stop tokens: both run to the budget
        i = next(j for j in range(len(x)) if x[j] != y[j])
        u = rng.uniforms(torch.tensor([q.params.seed]), torch.tensor([i])).item()
        p_plain, tok_plain = _draw_at(plain_book, u)
        p_tree, tok_tree = _draw_at(spec_book, u)
        assert (tok_plain, tok_tree) == (x[i], y[i])  # the draws the outputs hold
        d = max(_boundary_distance(p, u, x[i], y[i]) for p in (p_plain, p_tree))
        out.append((r, i, d))
    return out


def _requests(t, k, p, n: int, max_new: int, seed0: int = 0, caps: bool = True):
    """n requests (seeds seed0..) over PROMPT and two shorter prompts; with `caps`, a
    quarter each capped at 0, 1, 2 drafts (depth) and the rest uncapped, side by side."""
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:]]
    return [
        Request(
            prompts[i % 3],
            SamplingParams(
                t,
                top_k=k,
                top_p=p,
                max_new_tokens=max_new,
                stop_token_ids=(),
                seed=seed0 + i,
                max_draft=(i % 4 if i % 4 < 3 else None) if caps else None,
            ),
        )
        for i in range(n)
    ]


PLAIN: dict = {}


def _assert_plain_tokens(target, engine, reqs, monkeypatch) -> tuple[list, list, list]:
    """Generate `reqs` plainly and with `engine` (the plain run is cached per request
    set), recording every draw; assert that every request's tokens are plain decoding's
    but for rounding flips. Returns (divergences, plain results, engine results)."""
    book = _record_draws(monkeypatch)
    key = repr(reqs)
    if key not in PLAIN:
        PLAIN[key] = (Engine(target, EngineConfig(max_batch=len(reqs))).generate(reqs), list(book))
        book.clear()
    plain, plain_book = PLAIN[key]
    spec = engine.generate(reqs)
    div = _divergences(reqs, plain, spec, plain_book, book)
    bad = [x for x in div if x[2] > FLIP_TOL]
    assert not bad, f"{len(bad)} of {len(reqs)} requests differ, not by a rounding flip: {bad[:5]}"
    assert len(div) <= len(reqs) // 50, div  # flips are rare, or the test is blind
    return div, plain, spec


N_DET = 96
"""Requests per deterministic comparison (x 16 tokens: ~1.5k draws, most through trees)."""

DET_CASES = [(4, SETTINGS[0]), (16, SETTINGS[1]), (64, SETTINGS[2]), (16, SETTINGS[3])]
DET_GRID = [  # every setting and every size in the default suite, the whole grid under -m slow
    pytest.param(n, s, marks=() if (n, s) in DET_CASES else pytest.mark.slow)
    for n in (4, 16, 64)
    for s in SETTINGS
]
HISTORY_CASES = [
    (False, SETTINGS[0]),
    (False, SETTINGS[2]),
    (False, SETTINGS[3]),
    (True, SETTINGS[1]),
]
HISTORY_GRID = [
    pytest.param(h, *s, marks=() if (h, s) in HISTORY_CASES else pytest.mark.slow)
    for h in (False, True)
    for s in SETTINGS
]


@pytest.mark.parametrize("nodes,setting", DET_GRID)
def test_random_trees_give_plain_decodings_tokens(target, monkeypatch, nodes, setting):
    """Random trees (chains and bushes, duplicate siblings, tokens of any probability,
    zero under top-k / top-p included; a node budget filled or not), rows capped at
    0, 1, 2 drafts and uncapped side by side."""
    engine = Engine(target, EngineConfig(max_batch=N_DET), RandomTree(nodes), FixedDepth(nodes))
    _assert_plain_tokens(target, engine, _requests(*setting, N_DET, 16), monkeypatch)
    s = engine.stats
    assert s.draft_nodes > N_DET and s.accepted_tokens > N_DET // 2  # trees were walked


def test_a_full_fan_gives_plain_decodings_tokens_and_a_mask_that_leaks_siblings_fails(
    target, monkeypatch
):
    """Every first token is a candidate (acceptance 1 at depth 1), then a random subtree.
    With tree nodes that also see the nodes before them (a causal mask, as for a chain)
    while keeping their positions, deep tokens are drawn in the wrong context: most
    requests differ from plain decoding, and not by rounding flips."""
    from specroll.model import transformer

    reqs = _requests(1.0, 0, 1.0, N_DET, 16, caps=False)
    engine = Engine(target, EngineConfig(max_batch=N_DET), FullFan(), FixedDepth(32))
    _assert_plain_tokens(target, engine, reqs, monkeypatch)
    assert engine.stats.per_position[0] == 1.0

    layout = transformer.attention_layout

    def leaky(cfg, tokens, positions, cache, slot_start=0, max_start=None, tree=None):
        pos, mask, n, top = layout(cfg, tokens, positions, cache, slot_start, max_start, tree)
        if tree is not None:
            _, n_tree = tokens.shape
            causal = torch.ones(n_tree, n_tree, dtype=torch.bool).tril()
            _, mask, n, top = layout(
                cfg, tokens, positions, cache, slot_start, max_start, causal.expand_as(tree)
            )
        return pos, mask, n, top

    monkeypatch.setattr(transformer, "attention_layout", leaky)
    broken = Engine(target, EngineConfig(max_batch=N_DET), FullFan(), FixedDepth(32))
    with pytest.raises(AssertionError, match="not by a rounding flip"):
        _assert_plain_tokens(target, broken, reqs, monkeypatch)


@pytest.mark.parametrize("held,t,k,p", HISTORY_GRID)
def test_the_history_drafter_gives_plain_decodings_tokens(target, monkeypatch, held, t, k, p):
    """Every source on (the prompt, 96 live siblings, past rollouts that grow as rows
    finish), a tree of 16 nodes; or (`held`) the history held fixed at 8 old rollouts
    of the prompt and fresh seeds: each new rollout is plain decoding's draw for its own
    seed, whatever the history holds, so it is a fresh sample from the policy given its
    prefix (the conditional law, not just the marginal)."""
    if held:
        drafter = HistoryDrafter(sources=("prompt", "past"))
        olds = _old_outputs(target, 8, t, k, p, seed0=77)
    else:
        monkeypatch.setattr(history_module, "PAST", 64)
        drafter = HistoryDrafter()
        olds = _old_outputs(target, 32, t, k, p, seed0=10**6)
    for out in olds:
        drafter.remember(PROMPT, out)
    drafter.learn = not held  # held: finished rows do not join it
    engine = Engine(target, EngineConfig(max_batch=N_DET), drafter, FixedDepth(16))
    _assert_plain_tokens(target, engine, _requests(t, k, p, N_DET, 16), monkeypatch)
    assert engine.stats.accepted_tokens > N_DET  # history candidates are taken, often


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
def test_deep_trees_give_plain_decodings_own_tokens(target, monkeypatch, nodes, depth):
    """Sampling (T = 1, top-p 0.9) with the same seeds: the tree engine emits the tokens
    plain decoding emits (but for rounding flips), through accepted paths of every depth
    up to 8, with log-probs equal to rounding."""
    reqs = _requests(1.0, 0, 0.9, 32, 64, caps=False)
    outputs = {r.seed: r.token_ids for r in Engine(target).generate(reqs)}
    engine = Engine(
        target, EngineConfig(max_batch=32), PlantedPath(outputs, depth), FixedDepth(nodes)
    )
    div, plain, spec = _assert_plain_tokens(target, engine, reqs, monkeypatch)
    flipped = {r for r, _, _ in div}
    pairs = [(a, b) for r, (a, b) in enumerate(zip(plain, spec, strict=True)) if r not in flipped]
    lp = max(abs(x - y) for a, b in pairs for x, y in zip(a.logprobs, b.logprobs, strict=True))
    assert lp < 1e-3
    assert engine.stats.per_position[depth - 1] > 0.3  # the deepest level is reached
    assert engine.stats.acceptance_length > depth / 2


TREE_CHI2 = [  # nodes, (t, k, p): one case in the default suite, the whole grid under -m slow
    pytest.param(n, s, marks=() if (n, s) == (4, SETTINGS[0]) else pytest.mark.slow)
    for n in (4, 16, 64)
    for s in SETTINGS
]


@pytest.mark.parametrize("nodes,setting", TREE_CHI2)
def test_joint_distribution_with_random_trees_matches_plain_decoding(target, nodes, setting):
    """The tree family end to end by the suite's chi-square method (30k samples), with
    its power control (a 2% TV shift is rejected)."""
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


def test_replaying_an_old_sample_with_its_q_ratio_breaks_the_conditional_law(target):
    """The control for reuse: one old rollout (an older policy's sample) replayed as a
    chain with q = that policy keeps each token's marginal but makes the new rollout a
    function of the old one's randomness; the chi-square of the joint law under fresh
    seeds rejects it, biased towards the old rollout."""
    t, k, p = 1.0, 0, 1.0
    old = _old_outputs(target, 1, t, k, p, seed0=77)[0]
    old_policy = related_draft(target, noise=0.3)
    with torch.no_grad():
        logits = old_policy(torch.tensor([PROMPT + old])).logits[0, len(PROMPT) - 1 :]
    q = probs_from_logits(logits, RowSampling.full(len(logits), t, k, p))  # [len+1, V]
    replay = Engine(target, EngineConfig(max_batch=512), ReplayDrafter(old, q[:-1]), FixedDepth(3))
    n = N // 5  # the bias is gross (p underflows to 0 at 6k samples, 7 % against 0.3 %)
    replayed = sample_joint(replay, n, t, k, p, mixed=False)
    exact = exact_joint(target, t, k, p)
    assert chi2_pvalue(replayed, exact) < 1e-6
    i = old[0] * VOCAB**2 + old[1] * VOCAB + old[2]
    assert replayed[i] / n > exact[i] + 0.02  # biased towards the old rollout


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


def test_the_walk_along_the_engines_samples_is_the_engines_run(target, monkeypatch):
    """`engine.walk` predicts acceptance without a forward; along the engine's own
    samples it is the engine's run, iteration for iteration (groups of 8 siblings, a
    remembered past, rows finishing at different times)."""
    from specroll.engine.walk import walk

    monkeypatch.setattr(history_module, "PAST", 8)

    def drafter() -> HistoryDrafter:
        d = HistoryDrafter()
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


def test_the_history_keeps_a_bounded_number_of_prompts_and_rollouts(monkeypatch):
    for name, bound in (("PAST", 2), ("PROMPTS", 3), ("WINDOW", 4)):
        monkeypatch.setattr(history_module, name, bound)
    d = HistoryDrafter()
    for p in range(5):
        for r in range(3):
            d.remember([100 + p, 1, 2], [p, r, 7, 7])
    assert list(d.prompts) == [(102, 1, 2), (103, 1, 2), (104, 1, 2)]  # least recent out
    assert all(len(q.done) == 2 for q in d.prompts.values())
    assert len(d.recent) == 4 and len(d.others.seqs) == 4
    last = d.prompts[(104, 1, 2)]
    found = last.index.find((2, 4), limit=8)  # the prompt's end and the first token
    assert sorted(s[n] for _, s, n in found) == [1, 2]  # its last two rollouts (r = 1, 2)
