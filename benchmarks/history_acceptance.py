"""Offline-predicted against engine-measured acceptance of the history drafter.

On the embedded policy (SmolLM2) and procedural math prompts in GRPO groups of G: one
past epoch of plain samples goes into the drafter's history, then

* predicted: plain decoding samples the groups (seeds A) and the drafter's trees are
  walked along those samples (`engine.walk`: no forward);
* measured: the speculative engine samples the same groups (seeds B) with the drafter.

Both start from the same history. Tokens per row-iteration (emitted / row-forwards, the
quantity speculation lives on) are compared with a standard error from the spread over
responses; the final JSON line has every figure and the configuration.

    python benchmarks/history_acceptance.py --temperatures 1.0,0.7 --nodes 8c,16,64
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from specroll.cli import common
from specroll.drafters.history import HistoryDrafter
from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine.depth import FixedDepth
from specroll.engine.walk import walk
from specroll.tasks.sets import encode, prompt_set


def stderr(xs: list[float]) -> float:
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="math prompts (groups)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="1.0,0.7")
    ap.add_argument("--nodes", default="8c,16,64", help="node budgets; 'c' = a chain")
    args = ap.parse_args()
    model, tok = common.load_policy("smollm2")
    prompts = [encode(tok, p) for p in prompt_set("math", args.prompts, seed=1)]
    rows = []

    def reqs(t: float, seed0: int) -> list[Request]:
        return [
            Request(p, SamplingParams(t, max_new_tokens=args.new_tokens, seed=seed0 + i))
            for i, p in enumerate(q for q in prompts for _ in range(args.group))
        ]

    plain = Engine(model, EngineConfig(max_batch=args.group))
    for t in (float(x) for x in args.temperatures.split(",")):
        # per group (one prompt's G rows side by side), as a GRPO rollout batches them
        past = plain.generate(reqs(t, 10**9))
        sampled = plain.generate(reqs(t, 10**6))
        for spec in args.nodes.split(","):
            chain = spec.endswith("c")
            k = int(spec.rstrip("c"))
            base = HistoryDrafter(chain=chain)
            for r in past:
                base.remember(r.prompt_ids, r.token_ids)
            pred, meas = [], []
            walked = measured = None
            exact = True
            t0 = time.perf_counter()
            for g in range(args.prompts):
                sl = slice(g * args.group, (g + 1) * args.group)
                d = copy.deepcopy(base)
                w = walk(
                    d,
                    [r.prompt_ids for r in sampled[sl]],
                    [r.token_ids for r in sampled[sl]],
                    k,
                    args.new_tokens,
                )
                pred.append(w.tokens_per_target_forward)
                walked = w if walked is None else walked + w
                d = copy.deepcopy(base)
                eng = Engine(model, EngineConfig(max_batch=args.group), d, FixedDepth(k))
                out = eng.generate(reqs(t, 0)[sl])
                s = out.stats
                # the mechanism itself: walked along the engine's own samples, the
                # prediction is the measurement, iteration for iteration
                own = walk(
                    copy.deepcopy(base),
                    [r.prompt_ids for r in out],
                    [r.token_ids for r in out],
                    k,
                    args.new_tokens,
                )
                exact &= (own.row_forwards, own.emitted) == (s.row_forwards, s.emitted_tokens)
                meas.append(s.tokens_per_target_forward)
                measured = s if measured is None else measured.merged([measured, s])
            row = {
                "temperature": t,
                "drafter": f"history {'chain' if chain else 'tree'} k={k}",
                "predicted_tokens_per_target_forward": round(walked.tokens_per_target_forward, 4),
                "measured_tokens_per_target_forward": round(measured.tokens_per_target_forward, 4),
                "predicted_se": round(stderr(pred), 4),
                "measured_se": round(stderr(meas), 4),
                "walk_on_engine_samples_equals_measured": exact,
                "predicted_al": round(walked.acceptance_length, 4),
                "measured_al": round(measured.acceptance_length, 4),
                "measured_nodes_per_row": round(measured.draft_nodes / measured.row_forwards, 2),
                "draft_ms_per_iter": round(1e3 * measured.draft_s / measured.target_forwards, 3),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            print(row, flush=True)
            rows.append(row)
    print(
        json.dumps(
            {
                "bench": "history_acceptance",
                "model": "smollm2",
                "prompts": args.prompts,
                "group": args.group,
                "new_tokens": args.new_tokens,
                "past_epochs": 1,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
