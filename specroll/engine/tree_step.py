"""One engine iteration over draft trees: score every row's tree in one target forward,
walk it (`spec.tree.verify_tree`), keep the accepted path's keys and values in place.

The engine calls `run` when its drafter proposes trees (`Proposal.parents`); the rest of
the iteration (recording tokens, stop conditions, statistics) is the chain's. On the CPU
the walk is paced by the host (`spec.tree.verify_tree`: the LM head over the path only,
stopping at the deepest accepted node); elsewhere it is masked over every node's logits
(`verify_tree_masked`), so the iteration reads the device back once, after the step.
"""

from __future__ import annotations

import torch

from specroll.drafters.base import Drafter, Proposal
from specroll.engine.slots import Slots
from specroll.model.kv_cache import KVCache
from specroll.model.transformer import Transformer
from specroll.spec import rng, tree
from specroll.spec.tree import TreeVerifyOutput

HOST_PACED = ("cpu",)
"""Device types whose tree walk is paced by the host: reading back costs nothing there,
and the LM head then runs over the accepted path only."""


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
    paced = dev.type in HOST_PACED
    anc = tree.ancestors(parents, stop_early=paced)  # [B, N, N]
    depth = tree.depths(anc)  # [B, N]
    used = (parents >= 0) & (depth <= num_draft.unsqueeze(1))  # [B, N] verified nodes
    parents = parents.masked_fill(~used, -1)  # a cut node is nobody's child
    row_depth = (depth * used).amax(1)  # [B]
    D = int(row_depth.max()) if paced else k  # masked: a bound known without a read
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
    sampling = st.sampling(rows, range(B))
    u = rng.uniforms(st.seed[:B], st.n_gen[:B, None] + torch.arange(D + 1, **long))
    if paced:

        def logits(r: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
            return model.head_logits(h[r, nodes], packed)  # [n, V]: the path only

        ver = tree.verify_tree(logits, tokens, parents, D, sampling, u)
    else:  # one LM head over the whole tree, [B, N, V]
        ver = tree.verify_tree_masked(model.head_logits(h, packed), tokens, parents, D, sampling, u)
    tree.compact_path(cache.k, cache.v, rows, st.pos[:B], ver.path)
    along = ver.path.unsqueeze(-1)  # [B, D+1, 1]
    hidden = {i: out.hidden[i].gather(1, along.expand(-1, -1, h.shape[-1])) for i in layers}
    return ver, row_depth, used.sum(1), hidden
