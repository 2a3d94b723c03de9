"""What keeping a drafter costs when it never drafts: the default preset's step-0 requests
(64 rows, batch <= 32) generated plainly, and with each drafter under `FixedDepth(0)` (its
state kept every iteration, no proposal), interleaved, median of 3 after a warm-up round.
The same seeds give the same tokens, so the ratios are the drafters' idle cost alone.
Prints a final JSON line.

    python benchmarks/idle_overhead.py
"""

import json
import statistics
import sys
import time

import torch

from specroll.drafters.combined import CombinedDrafter
from specroll.drafters.history import HistoryDrafter
from specroll.engine import Engine, EngineConfig
from specroll.engine.depth import FixedDepth
from specroll.model import load_model
from specroll.model.hub import resolve
from specroll.model.tokenizer import Tokenizer
from specroll.rl.config import build_config
from specroll.rl.replica import replica
from specroll.rl.run.draft import build_draft
from specroll.rl.run.task import Task


def main() -> None:
    torch.set_num_threads(2)
    d = resolve("smollm2")
    policy, tok = load_model(d), Tokenizer(d)
    cfg = build_config("default", [])
    task = Task(cfg, tok)
    draft = build_draft(cfg, policy, tok, d)
    model = policy.eval()
    twin = replica(draft, model)
    reqs = task.step_requests(0)
    hist = HistoryDrafter()
    engines = {
        "plain": Engine(model, EngineConfig(max_batch=32)),
        "history": Engine(model, EngineConfig(max_batch=32), hist, FixedDepth(0)),
        "draft": Engine(model, EngineConfig(max_batch=32), twin.drafter(), FixedDepth(0)),
        "history+draft": Engine(
            model,
            EngineConfig(max_batch=32),
            CombinedDrafter(HistoryDrafter(), twin.drafter()),
            FixedDepth(0),
        ),
    }
    times = {k: [] for k in engines}
    for rep in range(4):
        for name, eng in engines.items():
            t = time.perf_counter()
            eng.generate(reqs)
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - t)
            print(f"round {rep + 1}/4 {name}: done", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "bench": "idle_overhead",
        "config": {"preset": "default", "requests": len(reqs), "max_batch": 32, "repeats": 3},
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "vs_plain": {k: round(v / med["plain"], 3) for k, v in med.items()},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
