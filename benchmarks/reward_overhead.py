"""What running the built-in rewards in the reward worker costs (issue 44, item 3).

The built-ins used to run in the trainer's process; they now run in the reward worker
with the user's functions (under `reward.timeout_s`, interruptible). This times, on
completions shaped like a policy's (a few lines of working, then 'Answer: N'):

  in_process  each built-in called directly, as the trainer used to
  worker      `RewardSet.score` through the worker (warm: started and loaded)
  cold_start  a new RewardSet's first score of one sample (process start, imports)

for batches of 64 and 512 samples, median of 5; the per-sample overhead is
(worker - in_process) / samples. The last line is a JSON object with every figure.

    python benchmarks/reward_overhead.py
"""

from __future__ import annotations

import json
import random
import statistics
import time

from specroll.tasks import reward_refs
from specroll.tasks.reward import BUILTINS
from specroll.tasks.rewards import RewardSet, Sample

FUNCTIONS = (("math",), ("math", "format"))
BATCHES = (64, 512)
REPEATS = 5


def completions(n: int, seed: int = 0) -> list[Sample]:
    """`n` samples: a few hundred characters of working and a final answer line."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        steps = " ".join(f"step {k}: {a} + {k} = {a + k}." for k in range(rng.randint(4, 12)))
        answer = a * b if rng.random() < 0.5 else a * b + 1
        text = f"We need {a} times {b}. {steps}\nSo the product is {a * b}.\nAnswer: {answer}"
        out.append(Sample(f"What is {a} * {b}?", text, {"answer": str(a * b)}, f"bench:{i}"))
    return out


def in_process(functions: tuple[str, ...], samples: list[Sample]) -> float:
    t0 = time.perf_counter()
    for name in functions:
        for s in samples:
            reward_refs.check_value(BUILTINS[name](s.prompt, s.completion, s.record))
    return time.perf_counter() - t0


def main() -> None:
    for fn in BUILTINS.values():  # imports are not what is measured
        fn("p", "Answer: 3", {"answer": "3"})
    rows = []
    for functions in FUNCTIONS:
        t0 = time.perf_counter()
        cold = RewardSet(functions)
        cold.start()
        cold.score(completions(1))
        cold_s = time.perf_counter() - t0
        cold.close()
        rs = RewardSet(functions)
        rs.start()
        rs.score(completions(4))  # loaded and warm
        for n in BATCHES:
            samples = completions(n, seed=n)
            local, remote = [], []
            for _ in range(REPEATS):
                local.append(in_process(functions, samples))
                t0 = time.perf_counter()
                rs.score(samples)
                remote.append(time.perf_counter() - t0)
            row = {
                "functions": list(functions),
                "samples": n,
                "in_process_s": round(statistics.median(local), 4),
                "worker_s": round(statistics.median(remote), 4),
                "overhead_per_sample_ms": round(
                    1e3 * (statistics.median(remote) - statistics.median(local)) / n, 4
                ),
                "cold_start_s": round(cold_s, 3),
            }
            print(row, flush=True)
            rows.append(row)
        rs.close()
    print(json.dumps({"repeats": REPEATS, "rows": rows}))


if __name__ == "__main__":
    main()
