"""Digests of the engine's tokens over drafters, seeds and slot counts, to hold a change
of the engine to the tokens it emitted before (tests/test_same_tokens.py).

Every drafter (plain, n-gram, draft model, EAGLE-3, MTP, history, combined), seeds,
1/3/5/8 slots for 12 random requests (more requests than slots: rows are compacted and
admitted mid-call), random prompts, budgets, stop ids, draft caps and sampling settings,
at a fixed depth and at one switching speculation on and off (a draft falls behind).

    PYTHONPATH=. python benchmarks/same_tokens.py --seeds 6 > digests.json

The digests in tests/fixtures/engine_tokens.json were recorded at commit d82c476 (before
issue 59's redesign of the engine step) on a 2-core AMD EPYC (Zen 4, AVX-512 BF16).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import warnings

from benchmarks.host_syncs import drafters, model
from specroll.engine.depth import FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.request import Request, SamplingParams

KINDS = ("plain", "ngram", "draft_model", "eagle3", "mtp", "history", "combined")
SLOTS = (1, 3, 5, 8)


class OnOff(FixedDepth):
    """k for three iterations, then 0 for three, ...: a draft's state falls behind."""

    def __init__(self, k: int) -> None:
        super().__init__(k=k, max_batch=64)
        self.calls = 0

    def choose(self, B: int, ctx: float) -> int:
        self.calls += 1
        return 0 if (self.calls // 3) % 2 else self.k


def random_requests(rnd: random.Random, n: int, prompt: int, budget: int) -> list[Request]:
    """n requests drawn from `rnd`: prompts of 1..`prompt` ids, budgets of 1..`budget`
    tokens, and random sampling settings, stop ids and draft caps."""
    return [
        Request(
            [rnd.randrange(64) for _ in range(rnd.randint(1, prompt))],
            SamplingParams(
                max_new_tokens=rnd.randint(1, budget),
                temperature=rnd.choice([0.0, 0.7, 1.0, 1.3]),
                top_k=rnd.choice([0, 0, 5]),
                top_p=rnd.choice([1.0, 1.0, 0.8]),
                stop_token_ids=tuple(rnd.sample(range(64), rnd.choice([0, 1, 3]))),
                seed=rnd.randrange(1000),
                max_draft=rnd.choice([None, None, 0, 1, 2]),
            ),
        )
        for _ in range(n)
    ]


def requests(seed: int) -> list[Request]:
    return random_requests(random.Random(seed), 12, 30, 40)


def digests(kind: str, seed: int, target=None, slots_of=SLOTS) -> dict[str, str]:
    """{"kind/seed/slots/onoff": digest of every request's tokens and finish reason}
    (`slots_of`: the slot counts run)."""
    target = model() if target is None else target
    out = {}
    for slots in slots_of:
        for onoff in (False, True) if kind != "plain" else (False,):
            d = drafters(target)[kind]()
            tree = d is not None and d.tree
            k = (4 + seed % 3 * 4) if tree else (1 + seed % 4)
            depth = None
            if d is not None:
                depth = OnOff(k) if onoff else FixedDepth(k=k, max_batch=64)
            eng = Engine(target, EngineConfig(max_batch=slots, seed=seed), d, depth)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # random drafts: collapse warnings
                res = eng.generate(requests(seed))
            blob = json.dumps([(r.token_ids, r.finish_reason) for r in res]).encode()
            out[f"{kind}/{seed}/{slots}/{int(onoff)}"] = hashlib.sha256(blob).hexdigest()[:16]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=6, help="seeds 0..N-1 (N >= 1)")
    args = p.parse_args()
    if args.seeds < 1:
        p.error(f"--seeds must be at least 1, got {args.seeds}")
    target = model()
    out = {}
    for kind in KINDS:
        for seed in range(args.seeds):
            out.update(digests(kind, seed, target))
        print(f"{kind}: {args.seeds} seeds", file=sys.stderr, flush=True)  # progress
    print(json.dumps(out, indent=0, sort_keys=True))


if __name__ == "__main__":
    main()
