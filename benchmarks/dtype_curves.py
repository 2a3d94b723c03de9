"""Training curves in bf16 against fp32: the same preset and seeds, rollouts and learner in
each dtype, with the rollout-learner mismatch statistics of every step.

    python benchmarks/dtype_curves.py                       # tiny preset, 3 seeds, 12 steps
    python benchmarks/dtype_curves.py --preset default --steps 4 --seeds 0

Each (seed, dtype) run is a fresh process-local Trainer in its own directory; the final
line is JSON: per run, the per-step reward, policy loss, and mismatch (mean/max |d log p|,
k3 KL), and per dtype the mean reward over seeds and steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from specroll.cli.common import load_policy
from specroll.rl.config import build_config
from specroll.rl.run.draft import build_draft
from specroll.rl.run.trainer import Trainer

KEYS = ("reward", "policy_loss", "logprob_mismatch_mean", "logprob_mismatch_max", "mismatch_kl")


def run(preset: str, seed: int, dtype: str, steps: int, out: Path, extra: list[str]) -> list:
    over = [
        f"pipeline.out_dir={out}",
        f"pipeline.steps={steps}",
        f"pipeline.seed={seed}",
        f"rollout.dtype={dtype}",
        f"learner.dtype={dtype}",
        "pipeline.checkpoint_every=0",
        "data.val_size=0",
        "learner.recompute_logprobs=always",  # the mismatch of every step, in both dtypes
        *extra,
    ]
    cfg = build_config(preset, over)
    torch.manual_seed(seed)
    policy, tok = load_policy(cfg.policy.model)
    draft = build_draft(cfg, policy, tok, out)
    trainer = Trainer(cfg, policy, tok, draft, log=lambda m: None)
    history = [m for m in trainer.run() if "time" in m]
    return [{k: m.get(k) for k in KEYS} | {"step_s": m["step_s"]} for m in history]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--set", action="append", default=[], help="extra overrides")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for dtype in ("float32", "bfloat16"):  # interleaved: the machine drifts
                key = f"seed{seed}-{dtype}"
                runs[key] = run(args.preset, seed, dtype, args.steps, Path(tmp) / key, args.set)
                rewards = " ".join(f"{m['reward']:.3f}" for m in runs[key])
                mm = [m["logprob_mismatch_max"] for m in runs[key]]
                mm_txt = " ".join("-" if x is None else f"{x:.1e}" for x in mm)
                print(f"{key:20s} reward {rewards}\n{'':20s} max|dlogp| {mm_txt}", flush=True)
    summary = {}
    for dtype in ("float32", "bfloat16"):
        ms = [m for k, v in runs.items() if k.endswith(dtype) for m in v]
        vals = {k: [m[k] for m in ms if m[k] is not None] for k in KEYS}
        summary[dtype] = {
            "reward_mean": statistics.mean(vals["reward"]),
            "mismatch_max": max(vals["logprob_mismatch_max"], default=None),
            "mismatch_mean_median": statistics.median(vals["logprob_mismatch_mean"])
            if vals["logprob_mismatch_mean"]
            else None,
            "mismatch_kl_median": statistics.median(vals["mismatch_kl"])
            if vals["mismatch_kl"]
            else None,
            "step_s_median": statistics.median(m["step_s"] for m in ms),
        }
    config = {"preset": args.preset, "steps": args.steps, "seeds": seeds, "set": args.set}
    print(json.dumps({"config": config, "summary": summary, "runs": runs}))


if __name__ == "__main__":
    main()
