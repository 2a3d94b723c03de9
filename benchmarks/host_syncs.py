"""Host synchronisations per engine iteration, plain and speculative, for every drafter.

Counts (not estimates) what `specroll.engine.syncs.HostSyncs` intercepts inside each
decode/verify iteration (`Engine._step`) and each prefill, on a small random model: the
count depends on the engine's code paths, not on the model's size. Mixed sampling rows
(greedy, top-k, top-p) and more requests than slots, so admission and compaction run.

    python benchmarks/host_syncs.py            # final line: JSON with the counts
    python benchmarks/host_syncs.py --masked-walk   # trees walked as on an accelerator
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter

import torch

from specroll import device
from specroll.drafters.combined import CombinedDrafter
from specroll.drafters.draft_model import DraftModelDrafter
from specroll.drafters.eagle3 import Eagle3Drafter
from specroll.drafters.history import HistoryDrafter
from specroll.drafters.mtp import MTPDrafter
from specroll.drafters.ngram import NgramDrafter
from specroll.drafting.eagle3_head import Eagle3Config, Eagle3Head
from specroll.drafting.mtp_heads import MTPConfig, MTPDraft
from specroll.engine.depth import FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.request import Request, SamplingParams
from specroll.engine.syncs import HostSyncs
from specroll.model.config import ModelConfig
from specroll.model.transformer import Transformer


def model(seed: int = 0) -> Transformer:
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=256,
    )
    return Transformer(cfg).init_weights(seed=seed, std=0.4).eval()


def drafters(target: Transformer) -> dict:
    def eagle3() -> Eagle3Drafter:
        head = Eagle3Head(Eagle3Config.for_target(target.cfg, 12), embed=target)
        return Eagle3Drafter(head.init_weights(3, 0.3))

    return {
        "plain": lambda: None,
        "ngram": lambda: NgramDrafter(n_max=2),
        "draft_model": lambda: DraftModelDrafter(model(1)),
        "eagle3": eagle3,
        "mtp": lambda: MTPDrafter(
            MTPDraft(MTPConfig.for_target(target.cfg, num_mtp=2), target).init_weights(4, 0.3)
        ),
        "history": HistoryDrafter,
        "combined": lambda: CombinedDrafter(HistoryDrafter(), eagle3()),
    }


def requests(n: int = 12) -> list[Request]:
    params = [
        SamplingParams(max_new_tokens=24, temperature=1.0),
        SamplingParams(max_new_tokens=24, temperature=0.0),
        SamplingParams(max_new_tokens=24, temperature=0.8, top_k=8),
        SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9),
    ]
    g = torch.Generator().manual_seed(0)
    return [
        Request(torch.randint(0, 64, (5 + i % 4,), generator=g).tolist(), params[i % 4])
        for i in range(n)
    ]


def count(engine: Engine) -> dict:
    """Syncs of every `_step` and `_prefill` call of one generate."""
    per_step: list[int] = []
    per_prefill: list[int] = []
    by_call: Counter[str] = Counter()
    sites: Counter[str] = Counter()
    step, prefill = engine._step, engine._prefill

    def counted(fn, into):
        def run(*a, **kw):
            with HostSyncs(sites=True) as s:
                out = fn(*a, **kw)
            into.append(s.total)
            by_call.update(s.by_call)
            if into is per_step:
                sites.update(s.sites)
            return out

        return run

    engine._step = counted(step, per_step)
    engine._prefill = counted(prefill, per_prefill)
    with HostSyncs() as whole:
        engine.generate(requests())
    engine._step, engine._prefill = step, prefill
    iters = len(per_step)
    return {
        "iterations": iters,
        "syncs_per_iteration_median": statistics.median(per_step),
        "syncs_per_iteration_max": max(per_step),
        "syncs_per_prefill_median": statistics.median(per_prefill),
        "syncs_per_generate": whole.total,
        "step_by_call": dict(sorted(by_call.items())),
        "step_sites": {site: round(n / iters, 2) for site, n in sorted(sites.items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--masked-walk",
        action="store_true",
        help="walk trees as on an accelerator (device.HOST_PACED empty): no host pacing",
    )
    args = ap.parse_args()
    if args.masked_walk:
        device.HOST_PACED = ()
    torch.manual_seed(0)
    target = model()
    out = {}
    for name, make in drafters(target).items():
        d = make()
        k = 8 if d is not None and d.tree else 3  # a tree's budget is its node count
        depth = FixedDepth(k=k, max_batch=64) if d is not None else None
        out[name] = count(Engine(target, EngineConfig(max_batch=8), d, depth))
        r = out[name]
        print(
            f"{name:12s} {r['iterations']:4d} iterations  syncs/iteration median "
            f"{r['syncs_per_iteration_median']}, max {r['syncs_per_iteration_max']}  "
            f"prefill {r['syncs_per_prefill_median']}  by call {r['step_by_call']}"
        )
    config = {
        "model": "random 4x32, vocab 64",
        "requests": 12,
        "max_batch": 8,
        "k": 3,
        "nodes": 8,
        "masked_walk": args.masked_walk,
    }
    print(json.dumps({"config": config, "results": out}))


if __name__ == "__main__":
    main()
