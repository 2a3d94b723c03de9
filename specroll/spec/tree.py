"""Draft trees, and their lossless verification in one target forward.

A row's tree has N nodes: node 0 is the row's `last` token (the root, already sampled,
not yet in the cache), nodes 1..N-1 are candidate tokens, each with a parent of smaller
index (`parents`, −1 for the root and for unused nodes). One target forward scores every
node: node i sits at position pos + depth(i), is written at cache position pos + i, and
attends to the cache and to its own ancestors (`ancestors`, the mask the model takes).

Verification (`verify_tree`) walks from the root. At a node with processed target
distribution p it draws y ~ p with the row's own uniform for that output index — the
very draw plain decoding makes there — and descends into the child whose token is y if
there is one, else emits y and stops. So every emitted token is a draw from p given
everything before it, whatever the candidates are (duplicates, zero-probability tokens,
tokens outside top-k/top-p: none can change y). It is the sequential rule of EAGLE-2/3
(accept x_i with probability p_i(x_i), p_{i+1} = p_i without x_i renormalised, and emit
from p without every child if all fail) in its equivalent single-draw form; the chance of
descending is Σ p(children), the most any lossless rule gets from fixed candidates.

Candidates are never samples: their own randomness (a sibling's, a past epoch's) is never
reused, so a rollout is a fresh draw from the current policy conditioned on its prefix,
not a function of an older rollout's randomness (what SPEC-RL's replay would make it).

The walk comes in two forms that draw the same tokens. `verify_tree` is paced by the
host: per depth it runs the LM head over the rows still descending and stops when none
is, which is cheapest where reading the device costs nothing (the CPU).
`verify_tree_masked` takes every node's logits (one LM head over the whole tree) and
walks a fixed number of depths over every row with a mask: no host read, the form an
accelerator needs (its stream never waits, and the step can be captured).

After verification the accepted path's keys and values are moved to the positions they
hold in the sequence (`compact_path`); the rest of the tree is overwritten later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specroll.spec.sampling import RowSampling, sample_from_probs, temper, truncate


def ancestors(parents: torch.Tensor, stop_early: bool | None = None) -> torch.Tensor:
    """[B, N] parent indices (−1: none) → [B, N, N] bool, [b, i, j] = node j is node i or
    one of its ancestors. Pointer doubling: log2(depth) boolean products, no Python per
    node. Parents must have smaller indices than their children. `stop_early`: stop
    squaring at the tree's depth, which reads the device back (default: on the CPU
    only, where looking costs nothing); otherwise all log2(N) squarings run (the fixed
    point is the same)."""
    B, N = parents.shape
    eye = torch.eye(N, dtype=torch.bool, device=parents.device).expand(B, N, N)
    up = torch.nn.functional.one_hot(parents.clamp(min=0), N).bool()  # [B, N, N]
    anc = eye | (up & (parents >= 0).unsqueeze(-1))
    look = parents.device.type == "cpu" if stop_early is None else stop_early
    reach = 1
    while reach < N:  # anc covers ancestors up to `reach` levels up; square to double it
        nxt = torch.bmm(anc.float(), anc.float()) > 0
        if look and torch.equal(nxt, anc):
            break
        anc, reach = nxt, reach * 2
    return anc


def depths(anc: torch.Tensor) -> torch.Tensor:
    """[B, N, N] from `ancestors` → [B, N] depth of each node (root 0)."""
    return anc.sum(-1) - 1


def chain_parents(B: int, k: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, k] parents of a chain of k drafts: draft j (node j + 1) hangs under node j."""
    return torch.arange(k, device=device).expand(B, k).clone()


@dataclass
class TreeVerifyOutput:
    tokens: torch.Tensor
    """[B, D + 1] emitted ids (accepted path, then the token drawn where it stopped), −1
    after the first `num_emitted[b]`."""
    num_accepted: torch.Tensor
    """[B] accepted tree depth (0..D)."""
    accepted: torch.Tensor
    """[B, D] bool: the path reached depth i + 1 (cumulative)."""
    logprobs: torch.Tensor
    """[B, D + 1] log-prob of each emitted token under its processed distribution (fp32)."""
    path: torch.Tensor
    """[B, D + 1] node index at each depth of the accepted path (node 0 first; entries
    past num_accepted repeat the last node)."""

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1


def verify_tree(
    node_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depth: int,
    sampling: RowSampling,
    u_sample: torch.Tensor,
) -> TreeVerifyOutput:
    """Verify every row's draft tree (see the module docstring).

    node_logits(rows, nodes) → [n, V] raw target logits at node nodes[r] of row rows[r]
    (any float dtype; upcast to fp32): called once per depth for the rows still
    descending, so the LM head runs over the path, not over the whole tree.
    tokens: [B, N] node tokens (node 0's unused); parents: [B, N] (−1: root or unused
    node); depth: the deepest node (D). u_sample: [B, D + 1] float64, u_sample[b, d]
    the uniform of row b's output index at depth d (its plain-decoding draw).
    """
    out, lp, path, accepted, cur, rows = _walk_state(tokens.shape[0], depth, tokens.device)
    for d in range(depth + 1):
        raw = node_logits(rows, cur[rows]).float()  # [n, V]
        y, lp[rows, d] = _draw(raw, sampling, rows, u_sample[rows, d])
        out[rows, d] = y
        # the child of the current node whose token is y (first of duplicates), if any
        child = (parents[rows] == cur[rows].unsqueeze(1)) & (tokens[rows] == y.unsqueeze(1))
        found = child.any(1)
        if d == depth or not bool(found.any()):
            break
        rows, nxt = rows[found], child[found].float().argmax(1)
        accepted[rows, d] = True
        cur[rows] = nxt
        path[rows, d + 1 :] = nxt.unsqueeze(1)
    return TreeVerifyOutput(out, accepted.sum(1), accepted, lp, path)


def verify_tree_masked(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depth: int,
    sampling: RowSampling,
    u_sample: torch.Tensor,
) -> TreeVerifyOutput:
    """`verify_tree` with every node's raw target logits given (logits: [B, N, V]) and
    no host read: all `depth` + 1 steps run over every row, a row that stopped masked out
    (depth may be any bound on the deepest node). Same draws, same output."""
    out, lp, path, accepted, cur, rows = _walk_state(tokens.shape[0], depth, tokens.device)
    live = torch.ones_like(cur, dtype=torch.bool)  # still descending
    for d in range(depth + 1):
        raw = logits[rows, cur].float()  # [B, V]
        y, logp = _draw(raw, sampling, rows, u_sample[:, d])
        out[:, d] = torch.where(live, y, out[:, d])
        lp[:, d] = torch.where(live, logp, lp[:, d])
        if d == depth:
            break
        child = (parents == cur.unsqueeze(1)) & (tokens == y.unsqueeze(1))  # [B, N]
        live = live & child.any(1)
        nxt = child.float().argmax(1)  # the first of duplicates
        accepted[:, d] = live
        cur = torch.where(live, nxt, cur)
        path[:, d + 1 :] = torch.where(live.unsqueeze(1), nxt.unsqueeze(1), path[:, d + 1 :])
    return TreeVerifyOutput(out, accepted.sum(1), accepted, lp, path)


def _walk_state(B: int, depth: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """A walk's outputs before its first step — emitted ids (−1: none) [B, D+1], their
    log-probs [B, D+1], the path [B, D+1], acceptances [B, D] — and its state: each
    row's current node [B] (the root) and the row indices [B]."""
    long = dict(dtype=torch.long, device=dev)
    return (
        torch.full((B, depth + 1), -1, **long),
        torch.zeros(B, depth + 1, dtype=torch.float32, device=dev),
        torch.zeros(B, depth + 1, **long),
        torch.zeros(B, depth, dtype=torch.bool, device=dev),
        torch.zeros(B, **long),
        torch.arange(B, **long),
    )


def _draw(
    raw: torch.Tensor, sampling: RowSampling, rows: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' draws from their processed distributions (raw: [n, V] fp32 logits of
    `rows`; u: [n] float64 uniforms) → (tokens [n], their log-probs [n])."""
    s, hints = sampling[rows], sampling.hints
    # the batch's hints hold for any subset of it (they only say what may be needed)
    x = truncate(temper(raw, s.temperature, hints), s.top_k, s.top_p, hints)
    lse = x.logsumexp(-1, keepdim=True)
    y = sample_from_probs((x - lse).exp(), u)  # [n]
    if sampling.any_greedy():  # from the host hints: no device read
        y = torch.where(s.greedy, raw.argmax(-1), y)
    return y, (x.gather(1, y.unsqueeze(1)) - lse).squeeze(1)


def compact_path(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, path: torch.Tensor
) -> None:
    """Move each row's accepted path to its sequence positions, in place.

    k, v: [L, S, Hkv, max_len, hd] caches; slots: [B] the rows' slots; pos: [B] each
    row's root position; path: [B, D + 1] from `verify_tree`. Node path[b, d] was written
    at pos + path[b, d] and belongs at pos + d (path[b, d] >= d, so reading every source
    before writing is safe). Unaccepted depths repeat a node already in place or move a
    key that the next forward overwrites."""
    L, S, H, M, hd = k.shape
    D1 = path.shape[1]
    dst = pos.unsqueeze(1) + torch.arange(D1, device=pos.device)  # [B, D+1]
    src = pos.unsqueeze(1) + path
    src, dst = src.clamp(max=M - 1), dst.clamp(max=M - 1)
    base = (slots.view(-1, 1, 1) * H + torch.arange(H, device=pos.device).view(1, -1, 1)) * M
    s_idx = (base + src.unsqueeze(1)).flatten()  # [B * H * (D+1)]
    d_idx = (base + dst.unsqueeze(1)).flatten()
    for c in (k, v):
        flat = c.view(L, S * H * M, hd)
        flat[:, d_idx] = flat[:, s_idx]
