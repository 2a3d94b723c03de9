"""The combined drafter's merged tree, chosen on the device.

`candidate_tree.best_first` chooses a row's nodes on the host, from estimates of both
sources: history's trie (host) and the draft network's candidates (device). Where the
tree walk is masked (an accelerator: `device.HOST_PACED`), reading the network's
candidates back to the host before the step would be the iteration's second stall. So
there the host sends history's nodes in and `merged_tree` makes the same choice with
tensor ops: the same nodes, the same estimates, the same float64 products, the same
order (−score, depth, path) — the same tree, bit for bit, as `best_first` would build
(`tests/test_combined.py` holds it to that on random tries).

Nodes are unions: history's H nodes first (as the host listed them), then the
network's d·w candidates that no history node already names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def network_paths(toks: torch.Tensor, D: int) -> torch.Tensor:
    """[B, d, w] candidates (column 0 the greedy path) → [B, d·w, D] each one's path:
    the greedy tokens before its position, then its own, then -1."""
    B, d, w = toks.shape
    col = torch.arange(D, device=toks.device).view(1, 1, 1, D)
    at = torch.arange(d, device=toks.device).view(1, d, 1, 1)
    greedy = F.pad(toks[:, :, 0], (0, D - d), value=-1).view(B, 1, 1, D)
    own = toks.unsqueeze(-1)  # [B, d, w, 1]
    paths = torch.where(col < at, greedy, torch.where(col == at, own, -1))
    return paths.reshape(B, d * w, D)


def merged_tree(
    hist_path: torch.Tensor,
    hist_parent: torch.Tensor,
    hist_est: torch.Tensor,
    toks: torch.Tensor,
    q: torch.Tensor,
    net_cap: torch.Tensor,
    c_hist: float,
    c_draft: float,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's k heaviest nodes of both sources, best first, parents first.

    hist_path [B, H, Dh]: history's nodes' paths (-1 past their depth); hist_parent
    [B, H] each one's parent among them (-1: the root); hist_est [B, H] float64 its
    frequency after its parent (0: no node). toks, q [B, d, w]: the network's
    candidates and their q (float64); net_cap [B] the positions of the network's path a
    row takes (0: none). c_hist, c_draft: the sources' calibrations.

    Returns (tokens [B, k], parents [B, k] as node indices, 0 the root; lengths [B];
    chosen [B, k] each node's index in the union, -1 past the row's length), padded as
    `candidate_tree.proposal` pads: token 0, parent its own index."""
    B, H, Dh = hist_path.shape
    d, w = toks.shape[1:]
    D, M, dev = max(Dh, d), d * w, toks.device
    hp = F.pad(hist_path, (0, D - Dh), value=-1)  # [B, H, D]
    npath = network_paths(toks, D)  # [B, M, D]
    hvalid = hist_est > 0
    depth_of = torch.arange(d, device=dev).repeat_interleave(w)  # [M]
    nvalid = (q.reshape(B, M) > 0) & (depth_of < net_cap.unsqueeze(1))  # [B, M]
    nq = torch.where(nvalid, q.reshape(B, M), 0.0)
    # a network candidate history also names joins that node (paths are unique in a trie)
    same = (npath.unsqueeze(2) == hp.unsqueeze(1)).all(-1)  # [B, M, H]
    same &= hvalid.unsqueeze(1) & nvalid.unsqueeze(2)
    matched = same.any(-1)  # [B, M]
    union_of = torch.where(matched, same.long().argmax(-1), H + torch.arange(M, device=dev))
    est_h = F.pad(hist_est, (0, M))  # [B, U]
    est_d = torch.cat([(same.double() * nq.unsqueeze(2)).sum(1), torch.where(matched, 0.0, nq)], 1)
    valid = torch.cat([hvalid, nvalid & ~matched], 1)  # [B, U]
    path = torch.cat([hp, npath], 1)  # [B, U, D]
    length = (path >= 0).sum(-1)  # [B, U]
    # a candidate's parent: the greedy node one position up (itself joined or not)
    up = torch.arange(M, device=dev) - w - torch.arange(M, device=dev) % w  # [M]
    net_parent = torch.where(up >= 0, union_of.gather(1, up.clamp(min=0).expand(B, M)), -1)
    parent = torch.cat([hist_parent, net_parent], 1)  # [B, U]
    score = _scores(est_h, est_d, valid, parent, length, c_hist, c_draft, D)
    order = _order(valid, score, length, path)  # [B, U] union indices, best first
    return _tree(order, valid, parent, path, length, k)


def _scores(
    est_h: torch.Tensor,
    est_d: torch.Tensor,
    valid: torch.Tensor,
    parent: torch.Tensor,
    length: torch.Tensor,
    c_hist: float,
    c_draft: float,
    D: int,
) -> torch.Tensor:
    """[B, U] each node's path score: its parent's times its largest calibrated estimate,
    capped at 1 (`best_first`'s products, in its order: parents first)."""
    B, U = est_h.shape
    inf = torch.tensor(float("-inf"), dtype=torch.float64, device=est_h.device)
    cond = torch.maximum(
        torch.where(est_h > 0, (c_hist * est_h).clamp(max=1.0), inf),
        torch.where(est_d > 0, (c_draft * est_d).clamp(max=1.0), inf),
    )
    cond = torch.where(valid, cond, 0.0)
    score = torch.ones(B, U + 1, dtype=torch.float64, device=est_h.device)  # column U: root
    up = torch.where(parent < 0, U, parent)
    for level in range(1, D + 1):
        at = score.gather(1, up) * cond
        score[:, :U] = torch.where(length == level, at, score[:, :U])
    return torch.where(valid, score[:, :U], 0.0)


def _order(
    valid: torch.Tensor, score: torch.Tensor, length: torch.Tensor, path: torch.Tensor
) -> torch.Tensor:
    """[B, U] the union's indices sorted by (not valid, −score, depth, path), as Python
    compares those tuples: stable sorts, least significant key first."""
    B, U, D = path.shape
    order = torch.arange(U, device=path.device).expand(B, U)
    keys = [path[..., c] for c in reversed(range(D))] + [length, -score, (~valid).long()]
    for key in keys:
        order = order.gather(1, key.gather(1, order).sort(dim=1, stable=True).indices)
    return order


def _tree(
    order: torch.Tensor,
    valid: torch.Tensor,
    parent: torch.Tensor,
    path: torch.Tensor,
    length: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first k nodes of `order` as (tokens, parents, lengths, chosen) (`merged_tree`)."""
    B, U = order.shape
    dev = order.device
    if U < k:
        order = F.pad(order, (0, k - U), value=0)
    chosen = order[:, :k]  # [B, k]
    lengths = valid.sum(1).clamp(max=k)  # [B]
    filled = torch.arange(k, device=dev) < lengths.unsqueeze(1)  # [B, k]
    at = (length.gather(1, chosen) - 1).clamp(min=0)  # [B, k]
    tokens = path.gather(1, chosen.unsqueeze(-1).expand(B, k, path.shape[2]))
    tokens = tokens.gather(2, at.unsqueeze(-1)).squeeze(-1)
    rank = torch.empty_like(order[:, :U]).scatter_(
        1, order[:, :U], torch.arange(U, device=dev).expand(B, U)
    )
    up = parent.gather(1, chosen)  # [B, k]
    parents = torch.where(up < 0, 0, rank.gather(1, up.clamp(min=0)) + 1)
    own = torch.arange(k, device=dev).expand(B, k)
    return (
        torch.where(filled, tokens, 0),
        torch.where(filled, parents, own),
        lengths,
        torch.where(filled, chosen, -1),
    )
