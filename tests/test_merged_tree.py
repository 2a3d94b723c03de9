"""The combined drafter's tree chosen on the device (`drafters.merged_tree`) is the tree
the host chooses (`candidate_tree.best_first`): the same nodes, tokens, parents and
lengths, on random tries and network candidates made to collide with them and to tie."""

from __future__ import annotations

import random

import pytest
import torch

from specroll.drafters.candidate_tree import add_path, add_trie, best_first, tree_of, trie
from specroll.drafters.merged_tree import merged_tree


def _row(rng: random.Random, vocab: int, depth: int, d: int, w: int):
    """One row: history occurrences, network candidates (some on history's paths), caps."""
    seqs = [[rng.randrange(vocab) for _ in range(depth)] for _ in range(rng.randrange(0, 6))]
    occ = [(s, 0, float(rng.choice([1, 1, 2, 0.5]))) for s in seqs]
    root, total = trie(occ, depth)
    greedy = list(seqs[0]) if seqs and rng.random() < 0.6 else []  # follow history a while
    greedy = greedy[: rng.randrange(0, d + 1)]
    greedy += [rng.randrange(vocab) for _ in range(d - len(greedy))]
    toks, probs = [], []
    for i in range(d):
        others = rng.sample([t for t in range(vocab) if t != greedy[i]], w - 1)
        toks.append([greedy[i], *others])
        ps = sorted((rng.choice([0.5, 0.25, rng.random()]) for _ in range(w)), reverse=True)
        ps[0] = max(ps[0], 1e-3)  # the greedy token's q is never 0
        if rng.random() < 0.2:
            ps[-1] = 0.0  # a candidate the processors removed
        probs.append(ps)
    cap = rng.choice([0, 1, 3, depth, depth + 2])
    return root, total, toks, probs, cap


def _host(root, total, toks, probs, cap, c, k):
    """The host's choice (`CombinedDrafter._tree`): est, then best_first."""
    if cap <= 0:
        return None
    est: dict = {}
    if total > 0:
        add_trie(est, root, total, (), cap)
    add_path(est, toks, probs, cap)
    chosen = best_first(est, c, k)
    return chosen, est


def _hist_tensors(rows, H: int, D: int):
    """History's nodes as the device takes them (`CombinedDrafter` sends the same)."""
    B = len(rows)
    path = torch.full((B, H, D), -1, dtype=torch.long)
    parent = torch.full((B, H), -1, dtype=torch.long)
    est = torch.zeros(B, H, dtype=torch.float64)
    for b, nodes in enumerate(rows):
        index = {node: i for i, node in enumerate(nodes)}
        for i, (node, h) in enumerate(nodes.items()):
            path[b, i, : len(node)] = torch.tensor(node)
            parent[b, i] = index.get(node[:-1], -1)
            est[b, i] = h
    return path, parent, est


@pytest.mark.parametrize("seed", range(12))
def test_the_device_chooses_the_hosts_tree(seed):
    rng = random.Random(seed)
    B, vocab, depth, d, w, k = 6, 5, 4, 3, 3, rng.choice([2, 5, 9])
    c = {"history": rng.choice([0.7, 1.0, 1.6]), "draft": rng.choice([0.5, 1.0, 2.0])}
    rows = [_row(rng, vocab, depth, d, w) for _ in range(B)]
    hist = []
    for root, total, _, _, cap in rows:
        est: dict = {}
        if cap > 0 and total > 0:
            add_trie(est, root, total, (), cap)
        hist.append({node: e["history"] for node, e in est.items()})
    H = max(1, max(len(h) for h in hist))
    path, parent, est = _hist_tensors(hist, H, depth + 2)
    toks = torch.tensor([r[2] for r in rows])
    q = torch.tensor([r[3] for r in rows], dtype=torch.float64)
    net_cap = torch.tensor([r[4] for r in rows])
    tokens, parents, lengths, chosen = merged_tree(
        path, parent, est, toks, q, net_cap, c["history"], c["draft"], k
    )
    for b, (root, total, tk, pr, cap) in enumerate(rows):
        want = _host(root, total, tk, pr, cap, c, k)
        n = int(lengths[b])
        if want is None:
            assert n == 0
            continue
        nodes, _ = want
        assert n == len(nodes)
        want_tokens, want_parents = tree_of(nodes)
        assert tokens[b, :n].tolist() == want_tokens
        assert parents[b, :n].tolist() == want_parents
        names = (
            list(hist[b])
            + [None] * (H - len(hist[b]))
            + [(*[t[0] for t in tk[:i]], tk[i][j]) for i in range(d) for j in range(w)]
        )
        assert [names[u] for u in chosen[b, :n].tolist()] == nodes
        assert chosen[b, n:].eq(-1).all()


def test_a_changed_tie_break_is_caught():
    """The test has teeth: choosing ties by path the other way round breaks it."""
    from specroll.drafters import merged_tree as module

    order = module._order

    def reversed_paths(valid, score, length, path):
        return order(valid, score, length, torch.where(path >= 0, 100 - path, path))

    module._order = reversed_paths
    try:
        with pytest.raises(AssertionError):
            for seed in range(12):
                test_the_device_chooses_the_hosts_tree(seed)
    finally:
        module._order = order
