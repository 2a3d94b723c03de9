"""Speculation depth on the default rollout workload: measured, and predicted by the simulator.

The workload is the default preset's step-0 rollout (8 math prompts x 8 samples, T = 1,
128 new tokens, 32 cache slots) on SmolLM2 with the cached in-domain EAGLE-3 draft. It
runs with plain decoding (AR), fixed k in {1, 2, 3, 5, 7} at every batch size, the
previous default (k = 3 only while one row is active), and adaptive depth (k_max = 7),
`--repeats` times each, interleaved and in a rotating order (the machine is shared).
Speculative sampling draws the same distribution as plain decoding but not the same
samples, and with a few dozen rollouts the longest one sets the time; so repeat r uses
seed set r for every configuration, and a configuration's figure is its mean over the
repeats (same prompts and seeds as every other configuration). The adaptive policy keeps
its acceptance estimates across repeats, as it does across the steps of a training run;
a warm-up call on other seeds fills them.

Then the simulator predicts each configuration's generation time from inputs that are
*not* the measured times: the machine's hardware profile (`specroll bench profile`,
fitted on isolated forwards and short engine runs), each run's response lengths, the mean
prompt length, and one acceptance profile (the per-position acceptance of the k = 7 run).
Prints a table and one JSON line. Run:

    python benchmarks/depth_sweep.py --repeats 3 [--profile PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specroll.drafters.eagle3 import Eagle3Drafter
from specroll.engine.costmodel import CostModel
from specroll.engine.depth import AdaptiveDepth, FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.profile import MEASURE, PROFILE_PROMPTS_SEED, cached_profile
from specroll.engine.request import Request, SamplingParams
from specroll.model import load_model
from specroll.model.hub import resolve
from specroll.model.tokenizer import Tokenizer
from specroll.rl.config import build_config
from specroll.rl.run.draft import build_draft
from specroll.sim.rollout import Speculation, simulate_replica
from specroll.tasks.sets import encode, math_problems

sys.path.insert(0, str(Path(__file__).parent))
from bench_io import Parser, output  # noqa: E402


def requests(tok, prompts: int, samples: int, new_tokens: int, seed: int) -> list[Request]:
    """The pipeline's rollout requests for `prompts` problems x `samples` (see Trainer)."""
    out = []
    for i, p in enumerate(math_problems(prompts, seed, (1, 2))):
        ids = encode(tok, p)
        for g in range(samples):
            sp = SamplingParams(1.0, max_new_tokens=new_tokens, seed=seed * 1000 + i * samples + g)
            out.append(Request(ids, sp))
    return out


def conditional(per_position: list[float]) -> list[float]:
    """Cumulative per-position acceptance -> conditional alpha_j (see Speculation)."""
    out, prev = [], 1.0
    for c in per_position:
        out.append(c / prev if prev > 0 else 0.0)
        prev = c
    return out


def parse_args() -> argparse.Namespace:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--k-max", type=int, default=7)
    ap.add_argument("--profile", default="", help="hardware profile (default: cached/measured)")
    ap.add_argument("--out", type=output, default="", help="also write the JSON here")
    return ap.parse_args()


def load(profile: str) -> tuple:
    """(policy, tokenizer, drafter, hardware profile): SmolLM2, the default preset's
    EAGLE-3 draft, and the profile at `profile` (default: cached, or measured now)."""
    d = resolve("smollm2")
    policy, tok = load_model(d).eval(), Tokenizer(d)
    cfg = build_config("default", ["draft.init=offline"])
    head = build_draft(cfg, policy, tok, d).eval()
    drafter = Eagle3Drafter(head)
    cm = cached_profile(
        policy,
        drafter,
        [encode(tok, p) for p in math_problems(8, seed=PROFILE_PROMPTS_SEED)],
        profile or MEASURE,
    )
    return policy, tok, drafter, cm


def depth_configs(cm: CostModel, k_max: int) -> dict[str, FixedDepth | AdaptiveDepth | None]:
    """Every configuration's depth policy (None: plain decoding)."""
    depths: dict[str, FixedDepth | AdaptiveDepth | None] = {"ar": None}
    for k in (1, 2, 3, 5, 7):
        depths[f"k{k}"] = FixedDepth(k)
    depths["k3_tail"] = FixedDepth(3, max_batch=1)
    depths["adaptive"] = AdaptiveDepth(cm, k_max=k_max)
    return depths


def measure(engines: dict[str, Engine], sets: list[list[Request]]) -> dict[str, list[dict]]:
    """Repeat r runs every configuration on seed set r, in a rotating order."""
    names = list(engines)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(len(sets)):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            res = engines[n].generate(sets[r])
            dt = time.perf_counter() - t0
            s = res.stats
            runs[n].append(
                {
                    "s": dt,
                    "lengths": [len(x.token_ids) for x in res],
                    "al": s.acceptance_length,
                    "per_position": s.per_position,
                    "depth_hist": list(s.depth_hist),
                }
            )
            print(f"repeat {r} {n}: {dt:.2f} s  AL {s.acceptance_length:.3f}", flush=True)
    return runs


def speculation(
    dp: FixedDepth | AdaptiveDepth | None, alphas: list[float], k_max: int
) -> Speculation:
    """The simulator's description of one configuration."""
    if dp is None:
        return Speculation()
    if isinstance(dp, AdaptiveDepth):
        return Speculation(k_max, alphas, adaptive=True)
    return Speculation(dp.k, alphas[: dp.k], max_batch=dp.max_batch)


def compare(runs, depths, cm: CostModel, args, prompt_len: float, alphas) -> list[dict]:
    """Per configuration: the measured means beside the simulator's prediction from each
    run's response lengths."""
    ar_s = statistics.mean(x["s"] for x in runs["ar"])
    rows = []
    for n in runs:
        meas = statistics.mean(x["s"] for x in runs[n])
        tokens = statistics.mean(sum(x["lengths"]) for x in runs[n])
        spec = speculation(depths[n], alphas, args.k_max)
        preds = []
        for x in runs[n]:
            lengths = torch.tensor(x["lengths"], dtype=torch.float64)
            preds.append(simulate_replica(cm, lengths, args.max_batch, prompt_len, spec)["time"])
        pred = statistics.mean(preds)
        rows.append(
            {
                "config": n,
                "gen_s": round(meas, 3),
                "tokens": round(tokens, 1),
                "tok_s": round(tokens / meas, 2),
                "speedup": round(ar_s / meas, 3),
                "gen_s_runs": [round(x["s"], 3) for x in runs[n]],
                "acceptance_length": round(statistics.median(x["al"] for x in runs[n]), 3),
                "depth_hist": runs[n][-1]["depth_hist"],
                "sim_gen_s": round(pred, 3),
                "sim_err": round(pred / meas - 1, 4),
            }
        )
    sim_ar = next(r["sim_gen_s"] for r in rows if r["config"] == "ar")
    for row in rows:
        row["sim_speedup"] = round(sim_ar / row["sim_gen_s"], 3)
        row["sim_speedup_err"] = round(row["sim_speedup"] / row["speedup"] - 1, 4)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'config':>9} {'gen_s':>7} {'speedup':>7} {'AL':>5} {'sim_s':>7} {'err':>7}")
    for r in rows:
        print(
            f"{r['config']:>9} {r['gen_s']:7.2f} {r['speedup']:7.3f} "
            f"{r['acceptance_length']:5.2f} {r['sim_gen_s']:7.2f} {r['sim_err']:+7.1%}"
        )


def result(args, prompt_len: float, alphas, cm: CostModel, rows: list[dict]) -> dict:
    """The JSON line: workload, rows, and adaptive depth against the fixed depths."""
    fixed = [r for r in rows if r["config"] in ("k1", "k2", "k3", "k5", "k7")]
    best = min(fixed, key=lambda r: r["gen_s"])
    adaptive = next(r for r in rows if r["config"] == "adaptive")
    k3 = next(r for r in rows if r["config"] == "k3")
    return {
        "bench": "depth_sweep",
        "model": "smollm2",
        "workload": {
            "prompts": args.prompts,
            "samples": args.samples,
            "new_tokens": args.new_tokens,
            "max_batch": args.max_batch,
            "temperature": 1.0,
            "mean_prompt_len": round(prompt_len, 1),
        },
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "alphas": [round(a, 4) for a in alphas],
        "profile_fit_error": cm.meta.get("fit_error"),
        "rows": rows,
        "best_fixed": best["config"],
        "adaptive_vs_best_fixed": round(best["gen_s"] / adaptive["gen_s"], 3),
        "adaptive_vs_k3": round(k3["gen_s"] / adaptive["gen_s"], 3),
        "adaptive_vs_ar": adaptive["speedup"],
    }


def main() -> None:
    args = parse_args()
    policy, tok, drafter, cm = load(args.profile)
    sets = [
        requests(tok, args.prompts, args.samples, args.new_tokens, r) for r in range(args.repeats)
    ]
    warm = requests(tok, args.prompts, 2, args.new_tokens, seed=99)
    ecfg = EngineConfig(max_batch=args.max_batch)
    depths = depth_configs(cm, args.k_max)
    engines = {
        n: Engine(policy, ecfg) if dp is None else Engine(policy, ecfg, drafter, dp)
        for n, dp in depths.items()
    }
    for n, eng in engines.items():  # warm-up: caches, packing, adaptive estimates
        eng.generate(warm)
        print(f"warm {n}", flush=True)
    runs = measure(engines, sets)

    prompt_len = statistics.mean(len(q.prompt_ids) for q in sets[0])
    k7 = runs["k7"][-1]["per_position"]
    alphas = conditional(k7) + [0.0] * (args.k_max - len(k7))
    rows = compare(runs, depths, cm, args, prompt_len, alphas)
    print_table(rows)
    line = json.dumps(result(args, prompt_len, alphas, cm, rows))
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
