"""Candidate trees: tries of continuations and the best-first choice of their nodes.

Two drafters propose trees of deterministic candidates — the history drafter
(`drafters.history`) from what followed a row's earlier occurrences, the combined drafter
(`drafters.combined`) from that and a draft network's candidates — and both hand the
engine the same shape: each row's heaviest nodes, best first and parents first, padded
to the fullest row. The trie, the two orders and that shape are written here once.

* `trie`: what followed each occurrence (sequence, start, weight), merged: a node's
  weight / its parent's is the frequency with which its token followed.
* `tree_from`: a trie's heaviest nodes by weight (the history drafter's tree).
* `add_trie`, `add_path`, `best_first`: per-node conditional estimates of several
  sources, and the nodes with the highest calibrated path scores (the combined tree).
* `tree_of` and `proposal`: chosen nodes as (tokens, parents) and rows as a `Proposal`.

Best first with parents first is what lets one verified tree tell what every smaller
budget would have emitted (`engine.depth`, **Trees**).
"""

from __future__ import annotations

import heapq

import torch

from specroll.device import upload
from specroll.drafters.base import Proposal

Trie = dict[int, list]
"""token → [weight, children trie]: what followed a row's matches, merged."""
Node = tuple[int, ...]
"""A candidate: its path of tokens after the row's last one."""
Occurrence = tuple[list[int], int, float]
"""(sequence, start, weight): tokens from seq[start] followed a match of this weight."""


def trie(occurrences: list[Occurrence], depth: int) -> tuple[Trie, float]:
    """Merge what followed each occurrence (sequence, start, weight), up to `depth` tokens,
    into a trie → (trie, total weight): a node's weight / its parent's (the total at the
    root) is the frequency with which its token followed."""
    root: Trie = {}
    total = 0.0
    for seq, start, w in occurrences:
        total += w
        level = root
        for tok in seq[start : start + depth]:
            node = level.get(tok)
            if node is None:
                node = level[tok] = [0.0, {}]
            node[0] += w
            level = node[1]
    return root, total


def tree_from(
    occurrences: list[Occurrence],
    nodes: int,
    depth: int,
    chain: bool = False,
) -> tuple[list[int], list[int]]:
    """Merge what followed each occurrence (sequence, start, weight) into a trie and keep
    its `nodes` heaviest nodes no deeper than `depth` → (tokens, parents), parents as
    node indices (0 = the row's last token, j = tokens[j - 1]). A child weighs no more
    than its parent, so best-first order keeps every kept node's parent before it.
    `chain`: only the heaviest child of each node (one path)."""
    root, total = trie(occurrences, depth)
    if total <= 0:
        return [], []
    # (−weight, depth, order, token, parent entry, children): best first, parents first
    found: list[tuple] = []
    stack = [(root, 0, -1)]
    while stack:
        level, d, parent = stack.pop()
        items = level.items()
        if chain and items:
            items = [max(items, key=lambda kv: kv[1][0])]
        for tok, (w, children) in items:
            found.append((-w, d + 1, len(found), tok, parent))
            stack.append((children, d + 1, len(found) - 1))
    found.sort()
    found = found[:nodes]
    index = {entry[2]: i + 1 for i, entry in enumerate(found)}  # found order → node index
    tokens = [entry[3] for entry in found]
    parents = [0 if entry[4] < 0 else index[entry[4]] for entry in found]
    return tokens, parents


def add_trie(
    est: dict[Node, dict[str, float]], level: Trie, parent_w: float, prefix: Node, cap: int
) -> None:
    """The trie's nodes down to depth `cap` into `est`, each with its frequency after its
    parent as the "history" estimate."""
    if len(prefix) >= cap:
        return
    for tok, (w, children) in level.items():
        node = (*prefix, tok)
        est.setdefault(node, {})["history"] = w / parent_w
        add_trie(est, children, w, node, cap)


def add_path(
    est: dict[Node, dict[str, float]], toks: list[list[int]], probs: list[list[float]], cap: int
) -> None:
    """A draft network's greedy path (column 0) and, at each position, its other
    candidates into `est`, each with its q as the "draft" estimate."""
    prefix: Node = ()
    for i in range(min(len(toks), cap)):
        for tok, q in zip(toks[i], probs[i], strict=True):
            if q > 0:
                node = (*prefix, tok)
                est.setdefault(node, {})["draft"] = q
        prefix = (*prefix, toks[i][0])


def best_first(est: dict[Node, dict[str, float]], c: dict[str, float], k: int) -> list[Node]:
    """The k nodes with the highest calibrated path scores, best first, parents first: a
    node's score is the product along its path of each step's largest estimate, a
    source's scaled by its calibration c[source] (capped at 1)."""
    score: dict[Node, float] = {(): 1.0}
    for node in sorted(est, key=len):  # parents scored before their children
        cond = max(min(1.0, c[s] * v) for s, v in est[node].items())
        score[node] = score[node[:-1]] * cond
    del score[()]
    return heapq.nsmallest(k, score, key=lambda n: (-score[n], len(n), n))


def tree_of(chosen: list[Node]) -> tuple[list[int], list[int]]:
    """Nodes chosen parents first → (tokens, parents as node indices, 0 = the root)."""
    index = {node: i + 1 for i, node in enumerate(chosen)}
    return [node[-1] for node in chosen], [index.get(node[:-1], 0) for node in chosen]


def proposal(
    tokens: list[list[int]], parents: list[list[int]], lengths: list[int], device
) -> Proposal:
    """Rows' trees as a `Proposal` as wide as the fullest row: when the candidates are
    few, the target forward scores few (an unused node costs as much as one)."""
    B = len(lengths)
    width = max(lengths, default=0)
    rows = [[n, *t[:width], *p[:width]] for n, t, p in zip(lengths, tokens, parents, strict=True)]
    packed = upload(
        torch.tensor(rows, dtype=torch.long, device="cpu").view(B, 1 + 2 * width), device
    )
    return Proposal(
        tokens=packed[:, 1 : 1 + width],
        probs=None,
        lengths=packed[:, 0],
        parents=packed[:, 1 + width :],
    )
