"""Adaptive depth with a deliberately wrong hardware profile vs plain decoding.

Issue 13 (item 4): with a profile measured while the CPU was shared, adaptive depth made
generation *slower* than plain decoding (gen_speedup 0.889). Adaptive depth now
calibrates the profile online on the iteration times the engine measures, so a wrong
profile cannot keep it in a losing depth. This benchmark shows it on a rollout-like
workload: `--prompts` math prompts x `--samples` samples at T = 1, `--new-tokens` new
tokens with the engine's stop tokens on (as RL does), `--max-batch` cache slots, on
SmolLM2 with the given drafter. Modes, run interleaved (rotating order) for `--rounds`
rounds, each round on its own seeds:

* plain: an engine without a drafter (what the RL pipeline's shadow rollouts time);
* adaptive: AdaptiveDepth on the machine's profile (cached, or measured now; as in
  training, a cached one that disagrees with the measured times is marked stale and
  measured again by the next run);
* wrong: AdaptiveDepth on a deliberately wrong profile (default: draft costs / 10 and
  per_token / 5, so the profile says speculation pays even at large batches);
* wrong_nocal: the same wrong profile without online calibration (the behaviour the
  issue reported; `--modes` can leave it out);
* k0: the drafter attached but never drafting (FixedDepth(0)): the floor of what a
  speculative engine costs over plain decoding (features kept for the draft).

Each adaptive policy persists across rounds, as it does across the steps of a training
run, so round 0 includes its exploration. Speculative and plain decoding draw the same
distribution but not the same samples, so each mode is scored by its own tokens per
second; per round, ratio = mode tok/s / plain tok/s; the figures are medians over rounds
(round 0's ratio is also given). `time_ratio` is plain seconds / mode seconds, the
pipeline's gen_speedup (it also moves with sampled lengths). Prints progress, a table
and one JSON line (figures and configuration). Run:

    python benchmarks/adaptive_wrong_profile.py --rounds 3 [--drafter eagle3:PATH|default]

`--save-wrong PATH` also writes the wrong profile, for the same check in training:
`specroll train --preset default --set rollout.profile=PATH --set pipeline.shadow_every=1`
(a profile given by path is never marked stale; the run warns and corrects it online).

Runtime: about rounds x modes x (one rollout), ~1-2 minutes per round on a quiet 2-core
machine with the defaults, plus measuring the profile once if it is not cached.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from specroll.drafting import registry
from specroll.engine.costmodel import CostModel
from specroll.engine.depth import AdaptiveDepth, FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.profile import MEASURE, PROFILE_PROMPTS_SEED, cached_profile
from specroll.engine.request import Request, SamplingParams
from specroll.model import load_model
from specroll.model.hub import home, resolve
from specroll.model.tokenizer import Tokenizer
from specroll.tasks.sets import encode, prompt_set

sys.path.insert(0, str(Path(__file__).parent))
from bench_io import Parser, output  # noqa: E402

DRAFT_FIELDS = ("draft_fixed", "draft_per_row", "draft_step", "draft_step_per_row")


class Uncalibrated(AdaptiveDepth):
    """Adaptive depth from the profile alone (no online time calibration, no
    exploration): how the policy behaved before issue 13."""

    def observe_time(self, batch_size: int, k: int, ctx: float, seconds: float) -> None:
        pass

    def choose(self, batch_size: int, ctx: float = 0.0) -> int:
        self.acceptance.relax_later()
        return self.best(batch_size, ctx)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def wrong_profile(cm: CostModel, spec: str) -> CostModel:
    """`cm` with coefficients scaled: 'draft=0.1,per_token=0.2' ('draft' = all draft terms)."""
    scale: dict[str, float] = {}
    for part in filter(None, spec.split(",")):
        name, _, value = part.partition("=")
        for f in DRAFT_FIELDS if name == "draft" else (name,):
            if f not in CostModel.__dataclass_fields__ or f == "meta":
                raise SystemExit(f"--wrong: unknown cost-model field {f!r}")
            scale[f] = float(value)
    meta = {k: v for k, v in cm.meta.items() if k not in ("cache_path", "target_points")}
    return dataclasses.replace(
        cm, **{f: getattr(cm, f) * s for f, s in scale.items()}, meta=meta | {"wrong": spec}
    )


def drafter_spec(spec: str) -> str:
    if spec != "default":
        return spec
    found = sorted((home() / "drafts").glob("*/draft/config.json"))
    if not found:
        raise SystemExit(f"no default draft under {home() / 'drafts'} (build one first)")
    return f"eagle3:{found[-1].parent}"


def requests(tok, args, seed: int) -> list[Request]:
    out = []
    for i, p in enumerate(prompt_set("math", args.prompts, seed)):
        ids = encode(tok, p)
        for g in range(args.samples):
            sp = SamplingParams(
                args.temperature, max_new_tokens=args.new_tokens, seed=seed * 100_003 + i * 101 + g
            )
            out.append(Request(ids, sp))  # stop_token_ids=None: the model's EOS tokens
    return out


def parse_args() -> argparse.Namespace:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--k-max", type=int, default=7)
    ap.add_argument("--drafter", default="ngram", help="ngram | eagle3:PATH | default | ...")
    ap.add_argument("--profile", default="", help="hardware profile JSON (default: cached)")
    ap.add_argument("--wrong", default="draft=0.1,per_token=0.2", help="scales of the profile")
    ap.add_argument("--modes", default="plain,adaptive,wrong,wrong_nocal,k0")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--out", type=output, default="", help="also write the JSON here")
    ap.add_argument(
        "--save-wrong", default="", help="write the wrong profile here (for rollout.profile=)"
    )
    return ap.parse_args()


def profiles(args, model, drafter, prompts: list[list[int]]) -> tuple[CostModel, CostModel]:
    """The machine's profile (cached, or measured now) and the deliberately wrong one
    (saved to `--save-wrong` when given)."""
    cm = cached_profile(model, drafter, prompts, args.profile or MEASURE, log)
    # as in training: a cached profile that disagrees with the measured times is marked
    # stale (measured again by the next run); the wrong one never touches the cache
    bad = wrong_profile(cm, args.wrong)
    if args.save_wrong:
        bad.save(args.save_wrong)
        log(f"wrong profile saved to {args.save_wrong}")
    return cm, bad


def depth_policies(right: CostModel, bad: CostModel, k_max: int) -> dict:
    """The depth policy of every speculative mode."""
    depths = {
        "adaptive": AdaptiveDepth(right, k_max=k_max),
        "wrong": AdaptiveDepth(bad, k_max=k_max),
        "wrong_nocal": Uncalibrated(bad, k_max=k_max),
    }
    depths["k0"] = FixedDepth(0)
    return depths


def profile_best_k(modes: list[str], adaptive: dict[str, AdaptiveDepth]) -> dict[str, list[int]]:
    """Each adaptive mode's best k by its profile alone, at B = 1..32 (logged)."""
    what_profile = {
        m: [adaptive[m].best(B, 100.0) for B in (1, 2, 4, 8, 16, 32)]
        for m in modes
        if m in adaptive
    }
    log(f"profile's best k at B = 1,2,4,8,16,32 (ctx 100): {what_profile}")
    return what_profile


def warm_up(engines: dict[str, Engine], prompt: list[int], temperature: float) -> None:
    warm = [
        Request(prompt, SamplingParams(temperature, max_new_tokens=4, seed=s)) for s in range(2)
    ]
    for eng in engines.values():  # weight packing, allocations
        eng.generate(warm)


def measure(engines: dict[str, Engine], modes: list[str], tok, args) -> dict[str, list[dict]]:
    """`--rounds` rounds, each on its own seeds, the modes in a rotating order."""
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        reqs = requests(tok, args, seed=1000 + r)
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for m in order:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t0 = time.perf_counter()
                res = engines[m].generate(reqs)
                dt = time.perf_counter() - t0
            s = res.stats
            n = sum(len(x.token_ids) for x in res)
            runs[m].append(
                {
                    "s": dt,
                    "tokens": n,
                    "tok_s": n / dt,
                    "al": s.acceptance_length,
                    "depth_hist": list(s.depth_hist),
                    "warnings": [str(w.message)[:160] for w in caught],
                }
            )
            log(
                f"round {r} {m:>11}: {dt:6.2f} s {n:5d} tok {n / dt:7.1f} tok/s  "
                f"AL {s.acceptance_length:.2f} depths {list(s.depth_hist)}"
            )
    return runs


def summarise(
    modes: list[str],
    runs: dict[str, list[dict]],
    adaptive: dict[str, AdaptiveDepth],
    what_profile: dict[str, list[int]],
) -> list[dict]:
    """One row per mode: medians over rounds, ratios to plain, and the adaptive modes'
    profile, calibration and warnings."""
    rows = []
    for m in modes:
        ratios = [x["tok_s"] / p["tok_s"] for x, p in zip(runs[m], runs["plain"], strict=True)]
        times = [p["s"] / x["s"] for x, p in zip(runs[m], runs["plain"], strict=True)]
        row = {
            "mode": m,
            "tok_s": round(statistics.median(x["tok_s"] for x in runs[m]), 2),
            "ratio_vs_plain": round(statistics.median(ratios), 4),
            "ratio_round0": round(ratios[0], 4),
            "ratio_runs": [round(x, 4) for x in ratios],
            "time_ratio": round(statistics.median(times), 4),
            "acceptance_length": round(statistics.median(x["al"] for x in runs[m]), 3),
            "depth_hist": runs[m][-1]["depth_hist"],
        }
        if m in adaptive:
            row["profile_best_k"] = what_profile[m]
            row["calibration"] = adaptive[m].calibration()
            row["disagreement"] = adaptive[m].disagreement
            row["warnings"] = sorted({w for x in runs[m] for w in x["warnings"]})
        rows.append(row)
    return rows


def log_table(rows: list[dict]) -> None:
    log(f"{'mode':>11} {'tok/s':>7} {'vs plain':>8} {'round 0':>8} {'time':>6} {'AL':>5}")
    for row in rows:
        log(
            f"{row['mode']:>11} {row['tok_s']:7.1f} {row['ratio_vs_plain']:8.3f} "
            f"{row['ratio_round0']:8.3f} {row['time_ratio']:6.3f} {row['acceptance_length']:5.2f}"
        )


def result(args, spec: str, cm: CostModel, rows: list[dict], t_start: float) -> dict:
    """The JSON line: configuration, profile and rows."""
    return {
        "bench": "adaptive_wrong_profile",
        "model": "smollm2",
        "drafter": spec,
        "workload": {
            "prompts": args.prompts,
            "samples": args.samples,
            "new_tokens": args.new_tokens,
            "max_batch": args.max_batch,
            "temperature": args.temperature,
            "stop_tokens": "eos",
        },
        "rounds": args.rounds,
        "k_max": args.k_max,
        "threads": torch.get_num_threads(),
        "wrong": args.wrong,
        "profile": str(Path(cm.meta.get("cache_path") or args.profile)),
        "profile_fit_error": cm.meta.get("fit_error"),
        "rows": rows,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    if "plain" not in modes:
        raise SystemExit("--modes must include plain (the reference)")

    t_start = time.perf_counter()
    path = resolve("smollm2")
    model, tok = load_model(path).eval(), Tokenizer(path)
    spec = drafter_spec(args.drafter)
    drafter = registry.build(spec, model)
    prof_prompts = [encode(tok, p) for p in prompt_set("math", 8, seed=PROFILE_PROMPTS_SEED)]
    cm, bad = profiles(args, model, drafter, prof_prompts)

    ecfg = EngineConfig(max_batch=args.max_batch)
    depths = depth_policies(cm, bad, args.k_max)
    engines = {
        m: Engine(model, ecfg) if m == "plain" else Engine(model, ecfg, drafter, depths[m])
        for m in modes
    }
    adaptive = {m: d for m, d in depths.items() if isinstance(d, AdaptiveDepth)}
    what_profile = profile_best_k(modes, adaptive)
    warm_up(engines, prof_prompts[0], args.temperature)

    runs = measure(engines, modes, tok, args)
    rows = summarise(modes, runs, adaptive, what_profile)
    log_table(rows)
    line = json.dumps(result(args, spec, cm, rows, t_start))
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
