"""One engine iteration over draft trees: score every row's tree in one target forward,
walk it (`spec.tree.verify_tree`), keep the accepted path's keys and values in place.

The engine calls `run` when its drafter proposes trees (`Proposal.parents`); the rest of
the iteration (recording tokens, stop conditions, statistics) is the chain's.
"""

from __future__ import annotations

import torch

from specroll.drafters.base import Drafter, Proposal
from specroll.engine.slots import Slots
from specroll.model.kv_cache import KVCache
from specroll.model.transformer import Transformer
from specroll.spec import rng, tree
from specroll.spec.tree import TreeVerifyOutput


def run(
    model: Transformer,
    cache: KVCache,
    st: Slots,
    B: int,
    prop: Proposal,
    num_draft: torch.Tensor,
    drafter: Drafter,
) -> tuple[TreeVerifyOutput, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Verify the trees of rows 0..B-1 (slots 0..B-1).

    A row keeps the nodes its proposal filled (`lengths`) no deeper than num_draft[b]
    (its cap, its budget, the context room). Returns (verification, each row's tree
    depth [B], its verified nodes [B], the drafter's hidden states along the accepted
    path ([B, D+1, H] per layer, as a chain's forward would give them))."""
    dev = st.device
    long = dict(dtype=torch.long, device=dev)
    rows = torch.arange(B, **long)
    k = prop.tokens.shape[1]
    tokens = torch.cat([st.last[:B, None], prop.tokens], dim=1)  # [B, N], N = k + 1
    parents = torch.cat([torch.full((B, 1), -1, **long), prop.parents], dim=1)  # [B, N]
    filled = k if prop.lengths is None else prop.lengths.unsqueeze(1)
    parents = parents.masked_fill(torch.arange(k + 1, **long) > filled, -1)
    anc = tree.ancestors(parents)  # [B, N, N]
    depth = tree.depths(anc)  # [B, N]
    used = (parents >= 0) & (depth <= num_draft.unsqueeze(1))  # [B, N] verified nodes
    parents = parents.masked_fill(~used, -1)  # a cut node is nobody's child
    row_depth = (depth * used).amax(1)  # [B]
    D = int(row_depth.max())
    layers = drafter.hidden_layers
    L = model.cfg.num_layers
    out = model(
        tokens,
        positions=st.pos[:B],
        cache=cache,
        hidden_layers=(*layers, L),
        return_logits=False,
        max_start=max(st.pos_host[:B]),
        tree=anc,
    )
    h = out.hidden[L]  # [B, N, H] last layer, before the final norm
    packed = model.packed_weights() or []
    ver = tree.verify_tree(
        lambda r, nodes: model.head_logits(h[r, nodes], packed),
        tokens,
        parents,
        D,
        st.sampling(rows, range(B)),
        rng.uniforms(st.seed[:B], st.n_gen[:B, None] + torch.arange(D + 1, **long)),
    )
    tree.compact_path(cache.k, cache.v, rows, st.pos[:B], ver.path)
    along = ver.path.unsqueeze(-1)  # [B, D+1, 1]
    hidden = {i: out.hidden[i].gather(1, along.expand(-1, -1, h.shape[-1])) for i in layers}
    return ver, row_depth, used.sum(1), hidden
