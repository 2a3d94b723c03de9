"""Host synchronisations: the counter counts what would stall a GPU, and the engine's
decode iteration reads the device back once (plain) — pinned, so a regression shows."""

from __future__ import annotations

import pytest
import torch

from benchmarks.host_syncs import count, drafters, model
from specroll import device
from specroll.engine.depth import FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.syncs import HostSyncs


def test_the_counter_counts_host_reads_and_nothing_else():
    t = torch.arange(6)
    with HostSyncs() as s:
        _ = t + 1, t.sum(), t[t.clamp(max=2)], t.view(2, 3)  # no host read
    assert s.total == 0
    with HostSyncs() as s:
        int(t[0]), bool(t.any()), float(t.float().mean()), t.tolist(), t.max().item()
        t.nonzero(), t[t > 2], [0, 1][t[1]]
    assert s.by_call == {
        "__int__": 1,
        "__bool__": 1,
        "__float__": 1,
        "tolist": 1,
        "item": 1,
        "nonzero": 1,
        "__getitem__": 1,  # the boolean mask (its True count sizes the result)
        "__index__": 1,
    }
    with HostSyncs(device="cuda") as s:  # CPU tensors are host data for a GPU run
        int(t[0])
    assert s.total == 0


# syncs per decode iteration: the one read-back (`StepRead`); drafters take what
# they need of the host from it. On the CPU a tree is walked paced by the host (a read per
# depth costs nothing there, and the LM head then runs over the path only); elsewhere it
# is masked, and a tree iteration reads once too (`device.HOST_PACED`). The combined
# drafter's merged tree is chosen on the device there (`drafters.merged_tree`), what it
# chose riding back on the one read. Documented in the README, measured by
# benchmarks/host_syncs.py.
PINNED = {"plain": 1, "ngram": 1, "draft_model": 1, "eagle3": 1, "mtp": 1, "history": 1}
PINNED |= {"combined": 1, "combined (merged)": 1}


@pytest.mark.parametrize("name", PINNED)
def test_decode_iterations_read_the_device_back_once(name, monkeypatch):
    monkeypatch.setattr(device, "HOST_PACED", ())  # walk trees as on an accelerator
    target = model()
    drafter = drafters(target)[name.split()[0]]()
    k = 8 if drafter is not None and drafter.tree else 3  # a tree's budget: its nodes
    depth = FixedDepth(k=k, max_batch=64) if drafter is not None else None
    if name == "combined (merged)":  # every speculative iteration the merged tree
        depth.forms.choose = lambda k: "merged"
    r = count(Engine(target, EngineConfig(max_batch=4), drafter, depth))
    assert r["iterations"] > 20  # 12 requests through 4 slots: admission and compaction ran
    assert r["syncs_per_iteration_max"] == PINNED[name], r
    assert r["syncs_per_iteration_median"] == 1, r
