"""What a checkpoint costs the training step: written on the critical path
(`checkpoint.save`) or in the background (`checkpoint.Writer`), for a state of the
default run's size, and how much a background write slows matrix products beside it.

    python benchmarks/checkpoint_cost.py              # final line: JSON with the figures
    python benchmarks/checkpoint_cost.py --gb 0.4     # a smaller state

A line per repeat on stderr (a background write beside busy products takes minutes).

The state is random fp32 tensors of `--gb` gigabytes (the default run's checkpoint:
policy, draft and both AdamW states of SmolLM2-135M, about 1.7 GB): the write's cost
depends on its bytes, not on what they mean. The products stand in for the learner's
step (2 threads, 1024² fp32), timed alone and while the background write runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from specroll.rl.run import checkpoint


def products(n: int = 20) -> float:
    """Seconds for n 1024² fp32 products (the learner's stand-in)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    t = time.perf_counter()
    for _ in range(n):
        a @ b
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.7, help="state size in GB (default 1.7)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each (default 3)")
    args = ap.parse_args()
    if not 0 < args.gb <= 8 or args.repeats < 1:
        ap.error("--gb must be in (0, 8] and --repeats at least 1")
    n = int(args.gb * 1e9 / 4 / 64)
    state = {"config": {}, "w": [torch.randn(n) for _ in range(64)]}
    alone = statistics.median(products() for _ in range(3))
    sync, start, done, beside = [], [], [], []
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.repeats):
            t = time.perf_counter()
            checkpoint.save(Path(d) / "sync", r, state, keep=1)
            sync.append(time.perf_counter() - t)
            writer = checkpoint.Writer()
            t = time.perf_counter()
            writer.start(Path(d) / "bg", r, state, keep=1)
            start.append(time.perf_counter() - t)
            while writer._thread is not None and writer._thread.is_alive():
                beside.append(products())
            writer.wait()
            done.append(time.perf_counter() - t)
            print(
                f"repeat {r + 1}/{args.repeats}: on the critical path {sync[-1]:.1f} s, "
                f"in the background {start[-1]:.2f} s (written after {done[-1]:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    med = lambda xs: round(statistics.median(xs), 3)  # noqa: E731
    out = {
        "config": {"gb": args.gb, "repeats": args.repeats, "threads": torch.get_num_threads()},
        "save_on_critical_path_s": med(sync),
        "background_start_s": med(start),
        "background_write_done_s": med(done),
        "products_alone_s": round(alone, 3),
        "products_beside_write_s": med(beside) if beside else None,
        "products_slowdown": round(med(beside) / alone, 3) if beside else None,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
