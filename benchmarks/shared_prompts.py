"""Stage `train` with an update's repeated prompts run once (`rl/learner/shared_prompts.py`)
against every row run from its first token, on a default-preset step.

The workload: `--prompts` math prompts of the default task x `--group` samples, random
responses of `--lengths` tokens (the learner's cost does not depend on which tokens),
SmolLM2-135M with the online EAGLE-3 draft, micro-batches of 16, in each `--dtypes`.
Each configuration trains its own copy of the same policy and draft; configurations
alternate within every round (one process: compare the ratios). Prints one line per
round and a final JSON line with the medians.

    PYTHONPATH=. python benchmarks/shared_prompts.py [--rounds 3] [--lengths 10,60]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from benchmarks.learner_stages import make_batch
from specroll.cli.common import load_policy
from specroll.rl.config import build_config
from specroll.rl.learner import shared_prompts
from specroll.rl.learner.build import build_learner
from specroll.rl.run.draft import build_draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lengths", default="10,60", help="response lengths lo,hi")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    policy, tok = load_policy("smollm2")
    lo, hi = (int(x) for x in args.lengths.split(","))
    batch = make_batch(tok, args.prompts, args.group, lo, hi, policy.cfg.vocab_size, 0)
    learners = {}
    for dtype in args.dtypes.split(","):
        cfg = build_config("default", ["draft.init=random", f"learner.dtype={dtype}"])
        for shared in (False, True):
            p = copy.deepcopy(policy)
            draft = build_draft(cfg, p, tok, None)
            learners[(dtype, shared)] = build_learner(cfg, p, draft, torch.device("cpu"))
    times: dict = {k: [] for k in learners}
    for r in range(args.rounds + 1):  # round 0 warms up
        keys = list(learners) if r % 2 else list(reversed(learners))
        for key in keys:
            shared_prompts.ENABLED = key[1]
            t = time.perf_counter()
            learners[key].train(batch, None)
            if r:
                times[key].append(time.perf_counter() - t)
        if r:
            print(
                r,
                {
                    f"{d}/{'shared' if s else 'plain'}": round(v[-1], 2)
                    for (d, s), v in times.items()
                },
            )
    shared_prompts.ENABLED = True
    rows = []
    for dtype in args.dtypes.split(","):
        plain = statistics.median(times[(dtype, False)])
        shared = statistics.median(times[(dtype, True)])
        rows.append(
            {
                "dtype": dtype,
                "plain_s": round(plain, 2),
                "shared_s": round(shared, 2),
                "speedup": round(plain / shared, 3),
            }
        )
    tokens = int(batch.lengths.sum())
    prompt = int(batch.prompt_lens.sum())
    config = {
        **vars(args),
        "tokens": tokens,
        "prompt_tokens": prompt,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps({"bench": "shared_prompts", "config": config, "rows": rows}))


if __name__ == "__main__":
    main()
