"""The default rollout with a GRPO group's prompt prefilled once (`engine/prompt_reuse.py`)
against every row prefilled from its own prompt, in one process.

The workload is the default preset's rollout shape: `--prompts` math prompts of the
default task (levels 1 and 2, chat template) x `--group` requests with distinct seeds,
`max_batch` 32, T = 1, up to 128 new tokens, EOS on, plain decoding (what most of a CPU
rollout is). Rounds alternate the order of the two settings; the prefill's seconds are
timed by wrapping the engine's prefill. Reports whether both settings emitted the same
tokens (float rounding can part a few responses at far-tail draws). Prints one line per
round and a final JSON line with the medians.

    PYTHONPATH=. python benchmarks/prompt_reuse.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specroll.cli.common import load_policy
from specroll.engine import Engine, EngineConfig, Request, SamplingParams, prompt_reuse
from specroll.engine.iteration import Stepper
from specroll.tasks.arithmetic import generate_problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model, tok = load_policy("smollm2")
    half = args.prompts // 2
    problems = generate_problems(half, 1, 0) + generate_problems(args.prompts - half, 2, 0)
    prompts = [tok.encode_prompt(p.prompt) for p in problems]
    reqs = [
        Request(p, SamplingParams(temperature=1.0, max_new_tokens=128, seed=1000 * i + j))
        for i, p in enumerate(prompts)
        for j in range(args.group)
    ]
    engine = Engine(model, EngineConfig(max_batch=args.max_batch))
    prefill = {"s": 0.0}
    plain_prefill = Stepper._prefill

    def timed(self, st, start, ps):
        t = time.perf_counter()
        plain_prefill(self, st, start, ps)
        prefill["s"] += time.perf_counter() - t

    Stepper._prefill = timed
    engine.generate(reqs[:2])  # warm-up
    times: dict[str, dict[str, list[float]]] = {
        k: {"total": [], "prefill": []} for k in ("plain", "reuse")
    }
    tokens = {}
    for r in range(args.rounds):
        for name in ("plain", "reuse") if r % 2 else ("reuse", "plain"):
            prompt_reuse.ENABLED = name == "reuse"
            prefill["s"] = 0.0
            t = time.perf_counter()
            out = engine.generate(reqs)
            times[name]["total"].append(time.perf_counter() - t)
            times[name]["prefill"].append(prefill["s"])
            tokens[name] = [r_.token_ids for r_ in out]
        print(r, {k: {m: round(v[-1], 2) for m, v in d.items()} for k, d in times.items()})
    prompt_reuse.ENABLED = True
    med = {k: {m: round(statistics.median(v), 2) for m, v in d.items()} for k, d in times.items()}
    result = {
        "bench": "prompt_reuse",
        "config": {**vars(args), "threads": torch.get_num_threads()},
        "same_tokens": tokens["plain"] == tokens["reuse"],
        "generated": sum(len(t) for t in tokens["reuse"]),
        **med,
        "speedup": round(med["plain"]["total"] / med["reuse"]["total"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
