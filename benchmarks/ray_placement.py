"""Placement and asynchrony on the default preset: exposed generation and step time.

Runs `specroll train` (the default preset, a few steps, no validation or shadow runs)
once per configuration, each in a fresh process:

    workers in {1, 2} x {sync, async (max_lag 1)} x speculation {on, off}

and reports, over the steps after the first (the first has nothing to overlap with),
the mean step time, the exposed generation time (what the learner waited for) and the
busy generation time (the slowest worker's wall time). On a 2-core machine the workers
and the learner share the same two cores, so overlap buys little here; the numbers say
how the pipeline behaves, and `specroll simulate` projects the same configurations to
GPUs. Prints a table and one JSON line. Run:

    python benchmarks/ray_placement.py --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(workers: int, lag: int, spec: bool, steps: int, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "specroll.cli", "train", "--steps", str(steps), "--out", str(out),
        "--set", "rollout.backend=ray", "--set", f"ray.workers={workers}",
        "--set", f"pipeline.max_lag={lag}", "--set", f"rollout.speculative={str(spec).lower()}",
        "--set", "data.val_size=0", "--set", "pipeline.shadow_every=0",
        "--set", "pipeline.checkpoint_every=0",
    ]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_s" in r][1:]  # steady state: after the first step
    mean = lambda key: round(statistics.mean(r[key] for r in rows), 3)  # noqa: E731
    return {
        "workers": workers,
        "mode": "async" if lag else "sync",
        "speculative": spec,
        "step_s": mean("step_s"),
        "exposed_gen_s": mean("exposed_gen_s"),
        "gen_busy_s": mean("gen_busy_s"),
        "train_s": round(statistics.mean(r["time"]["train"] for r in rows), 3),
        "logprob_s": round(statistics.mean(r["time"]["logprob"] for r in rows), 3),
        "acceptance_length": [r["acceptance_length"] for r in rows],
        "lag": [r["lag"] for r in rows],
        "wall_s": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in (True, False):
            for workers in (1, 2):
                for lag in (0, 1):
                    d = Path(tmp) / f"w{workers}-l{lag}-s{int(spec)}"
                    row = run(workers, lag, spec, args.steps, d)
                    print(row, flush=True)
                    out.append(row)
    print(f"{'spec':>5} {'workers':>7} {'mode':>5} {'step_s':>7} {'exposed':>8} {'busy':>6}")
    for r in out:
        print(
            f"{str(r['speculative']):>5} {r['workers']:>7} {r['mode']:>5} {r['step_s']:7.1f} "
            f"{r['exposed_gen_s']:8.2f} {r['gen_busy_s']:6.2f}"
        )
    print(
        json.dumps(
            {"bench": "ray_placement", "preset": "default", "steps": args.steps, "rows": out}
        )
    )


if __name__ == "__main__":
    main()
