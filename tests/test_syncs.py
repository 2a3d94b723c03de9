"""Host synchronisations: the counter counts what would stall a GPU, and the engine's
decode iteration reads the device back once (plain) — pinned, so a regression shows."""

from __future__ import annotations

import pytest
import torch

from specroll.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from specroll.drafters.ngram import NgramDrafter
from specroll.engine.depth import FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.request import Request, SamplingParams
from specroll.engine.syncs import HostSyncs
from specroll.model.config import ModelConfig
from specroll.model.transformer import Transformer


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


def _model() -> Transformer:
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
    )
    return Transformer(cfg).init_weights(seed=0, std=0.4).eval()


def _requests() -> list[Request]:
    params = [
        SamplingParams(max_new_tokens=20, temperature=1.0),
        SamplingParams(max_new_tokens=20, temperature=0.0),
        SamplingParams(max_new_tokens=20, temperature=0.8, top_k=8),
        SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9),
    ]
    g = torch.Generator().manual_seed(0)
    return [
        Request(torch.randint(0, 64, (5 + i % 4,), generator=g).tolist(), params[i % 4])
        for i in range(10)
    ]


# syncs per decode iteration: the one read-back of `Engine._accept`, plus what a drafter
# needs (ngram matches on the host; a hidden-state drafter sizes each draft forward's
# key axis and checks for rows to catch up): documented in the README, measured by
# benchmarks/host_syncs.py
PINNED = {"plain": 1, "ngram": 2, "eagle3": 9}


@pytest.mark.parametrize("name", list(PINNED))
def test_decode_iterations_read_the_device_back_a_pinned_number_of_times(name):
    target = _model()
    drafter = {
        "plain": lambda: None,
        "ngram": lambda: NgramDrafter(n_max=2),
        "eagle3": lambda: Eagle3Drafter(
            Eagle3Head(Eagle3Config.for_target(target.cfg, 12), embed=target).init_weights(3, 0.3)
        ),
    }[name]()
    depth = FixedDepth(k=3, max_batch=64) if drafter is not None else None
    engine = Engine(target, EngineConfig(max_batch=4), drafter, depth)
    counts: list[int] = []
    step = engine._step

    def counted(*a, **kw):
        with HostSyncs() as s:
            out = step(*a, **kw)
        counts.append(s.total)
        return out

    engine._step = counted
    results = engine.generate(_requests())
    assert len(results) == 10 and len(counts) > 20  # admission and compaction ran too
    assert max(counts) == PINNED[name], counts
