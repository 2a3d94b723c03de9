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

from specroll.device import host_paced
from specroll.engine.slots import Slots
from specroll.model.kv_cache import KVCache
from specroll.model.transformer import Transformer
from specroll.spec import rng, tree
from specroll.spec.sampling import RowSampling
from specroll.spec.tree import TreeVerifyOutput


def run(
    model: Transformer,
    cache: KVCache,
    st: Slots,
    n: int,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    lengths: torch.Tensor | None,
    num_draft: torch.Tensor,
    layers: tuple[int, ...],
    max_start: int,
    sampling: RowSampling,
    live: torch.Tensor | None = None,
) -> tuple[TreeVerifyOutput, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
    """Verify the trees of rows 0..n-1 (slots 0..n-1): tokens, parents [n, k] (a
    `Proposal`'s), lengths [n] the nodes each row filled (None: all k).

    A row keeps the nodes it filled no deeper than num_draft[b] (its cap, its budget,
    the context room; 0 for padding rows, `live` False: a captured step's, `engine.graphs`).
    max_start: the key axis (the deepest row's position, or a key bucket's). Returns
    (verification, each row's tree depth [n], its verified nodes [n], the drafter's hidden
    states `layers` along the accepted path ([n, D+1, H] each, as a chain's forward would
    give them))."""
    dev = st.device
    long = dict(dtype=torch.long, device=dev)
    rows = torch.arange(n, **long)
    k = tokens.shape[1]
    pos = st.pos[:n] if live is None else torch.where(live, st.pos[:n], 0)
    tokens = torch.cat([st.last[:n, None], tokens], dim=1)  # [n, N], N = k + 1
    parents = torch.cat([torch.full((n, 1), -1, **long), parents], dim=1)  # [n, N]
    filled = k if lengths is None else lengths.unsqueeze(1)
    parents = parents.masked_fill(torch.arange(k + 1, **long) > filled, -1)
    paced = host_paced(dev) and live is None
    anc = tree.ancestors(parents, stop_early=paced)  # [n, N, N]
    depth = tree.depths(anc)  # [n, N]
    used = (parents >= 0) & (depth <= num_draft.unsqueeze(1))  # [n, N] verified nodes
    parents = parents.masked_fill(~used, -1)  # a cut node is nobody's child
    row_depth = (depth * used).amax(1)  # [n]
    D = int(row_depth.max()) if paced else k  # masked: a bound known without a read
    L = model.cfg.num_layers
    out = model(
        tokens,
        positions=pos,
        cache=cache,
        hidden_layers=(*layers, L),
        return_logits=False,
        max_start=max_start,
        tree=anc,
    )
    h = out.hidden[L]  # [n, N, H] last layer, before the final norm
    packed = model.packed_weights() or []
    u = rng.uniforms(st.seed[:n], st.n_gen[:n, None] + torch.arange(D + 1, **long))
    if paced:

        def logits(r: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
            return model.head_logits(h[r, nodes], packed)  # [m, V]: the path only

        ver = tree.verify_tree(logits, tokens, parents, D, sampling, u)
    else:  # one LM head over the whole tree, [n, N, V]
        ver = tree.verify_tree_masked(model.head_logits(h, packed), tokens, parents, D, sampling, u)
    tree.compact_path(cache.k, cache.v, rows, pos, ver.path)
    along = ver.path.unsqueeze(-1)  # [n, D+1, 1]
    hidden = {i: out.hidden[i].gather(1, along.expand(-1, -1, h.shape[-1])) for i in layers}
    return ver, row_depth, used.sum(1), hidden
