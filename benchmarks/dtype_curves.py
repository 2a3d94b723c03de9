"""Training in bf16 against fp32: the same preset and seeds, one run per (seed, setting),
with every step's reward, stage times, rollout-learner mismatch and validation reward.

Settings (`--settings`, any of):

* `fp32`          rollouts and learner in fp32 (the default before `learner.dtype: auto`);
* `bf16-learner`  fp32 rollouts, bf16 learner (what `auto` picks where bf16 products pay):
                  old log-probs from the update's own forward, checked in fp32;
* `bf16`          rollouts and learner in bf16 (the engine samples the bf16 model; the
                  log-prob pass runs every step, so the mismatch of every step is logged).

    python benchmarks/dtype_curves.py --steps 30 --seeds 0            # a 30-step curve
    python benchmarks/dtype_curves.py --steps 10 --seeds 0,1,2        # val reward at 10
    python benchmarks/dtype_curves.py --preset tiny --steps 4         # a quick look

Runs are fresh process-local Trainers in their own directories, settings interleaved per
seed (the machine drifts), without checkpoints or shadow measurements. The final line is
JSON: per run the per-step figures, per setting the medians and the validation rewards.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specroll.cli.common import load_policy
from specroll.rl.config import build_config
from specroll.rl.run.draft import build_draft
from specroll.rl.run.trainer import Trainer

SETTINGS = {
    "fp32": ["rollout.dtype=float32", "learner.dtype=float32"],
    "bf16-learner": ["rollout.dtype=float32", "learner.dtype=bfloat16"],
    "bf16": ["rollout.dtype=bfloat16", "learner.dtype=bfloat16"],
}
"""The compared settings and their overrides."""
KEYS = (
    "reward",
    "val_accuracy",
    "policy_loss",
    "logprob_mismatch_mean",
    "logprob_mismatch_max",
    "mismatch_kl",
    "logprob_source",
    "step_s",
    "gen_tokens",
    "response_len_mean",
)


def run(preset: str, seed: int, setting: str, steps: int, out: Path, extra: list[str]) -> list:
    """One run's per-step figures (KEYS, and the gen / logprob / train seconds)."""
    over = [
        f"pipeline.out_dir={out}",
        f"pipeline.steps={steps}",
        f"pipeline.seed={seed}",
        "pipeline.checkpoint_every=0",
        "pipeline.shadow_every=0",
        *SETTINGS[setting],
        *extra,
    ]
    cfg = build_config(preset, over)
    torch.manual_seed(seed)
    policy, tok = load_policy(cfg.policy.model)
    draft = build_draft(cfg, policy, tok, out)
    trainer = Trainer(cfg, policy, tok, draft, log=lambda m: None)
    rows = []
    for m in trainer.run():
        if "time" in m:
            t = m["time"]
            stage = {k: round(t.get(k, 0.0), 3) for k in ("gen", "logprob", "train")}
            rows.append({k: m.get(k) for k in KEYS} | stage)
        elif "val_accuracy" in m and rows == []:  # step 0's validation
            rows.append({"step0_val_accuracy": m["val_accuracy"]})
    return rows


def _last_val(rows: list[dict]) -> float | None:
    """The run's last validation reward."""
    return next((m["val_accuracy"] for m in rows[::-1] if m.get("val_accuracy") is not None), None)


def summarise(runs: dict[str, list], settings: list[str]) -> dict:
    """Per setting: median stage seconds, mismatch extremes, mean reward, val rewards."""
    out = {}
    for s in settings:
        mine = {k: v for k, v in runs.items() if k.endswith(f"-{s}")}
        ms = [m for v in mine.values() for m in v if "step_s" in m]
        mm = [m["logprob_mismatch_max"] for m in ms if m["logprob_mismatch_max"] is not None]
        out[s] = {
            "step_s_median": statistics.median(m["step_s"] for m in ms),
            "gen_s_median": statistics.median(m["gen"] for m in ms),
            "train_s_median": statistics.median(m["train"] + m["logprob"] for m in ms),
            "mismatch_max": max(mm, default=None),
            "reward_mean": statistics.mean(m["reward"] for m in ms),
            "val_at_last_step": {k: _last_val(v) for k, v in mine.items()},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--settings", default="fp32,bf16-learner", help=",".join(SETTINGS))
    ap.add_argument("--set", action="append", default=[], help="extra overrides")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    settings = args.settings.split(",")
    for s in settings:
        if s not in SETTINGS:
            raise SystemExit(f"--settings: {s!r} is not one of {', '.join(SETTINGS)}")
    runs: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for s in settings:  # interleaved: the machine drifts
                key = f"seed{seed}-{s}"
                t0 = time.perf_counter()
                runs[key] = run(args.preset, seed, s, args.steps, Path(tmp) / key, args.set)
                steps = [m for m in runs[key] if "step_s" in m]
                rewards = " ".join(f"{m['reward']:.2f}" for m in steps)
                vals = " ".join(
                    f"{m['val_accuracy']:.3f}" for m in steps if m["val_accuracy"] is not None
                )
                print(
                    f"{key:22s} {time.perf_counter() - t0:6.0f} s  reward {rewards}  val {vals}",
                    flush=True,
                )
    config = {"preset": args.preset, "steps": args.steps, "seeds": seeds, "set": args.set}
    summary = summarise(runs, settings)
    print(json.dumps({"config": config, "summary": summary, "runs": runs}))


if __name__ == "__main__":
    main()
