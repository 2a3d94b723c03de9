"""Drafters compared at one checkpoint of a run, with the spread an RL step's single
shadow measurement cannot give.

A run's shadow rollouts (`pipeline.shadow_drafters`) measure each drafter once per shadow
step, on one realisation of the step's samples: speculative and plain decoding draw the
same distribution, not the same samples, and with answers of ~10 tokens a step's time is
set by its few longest ones (their tail decodes a row or two per iteration), so one
step's token-rate ratio moves by 10 % with the samples alone. This loads a checkpoint of
a run (its policy, online draft and history store) and, in each round, generates the
requests of one step — round r those of step `--step` + r, so that rounds differ in
prompts and seeds — plainly and with each drafter, the order reversed every other round;
each drafter drafts from the store as the checkpoint left it (`LocalRollout.alternative`).
A first round (step `--step` - 1) warms up — adaptive sizes start from their prior, as a
drafter's first step in a run does — and is not counted. Per drafter: its token rate over
all counted rounds against plain decoding's (tokens over seconds, summed), the median and
range of the per-round ratios, a paired sign-flip p-value of its per-round log token rate
against plain decoding's, and its tokens per row-iteration; and the run's own drafter
against each other one alike. Final JSON line.

    python benchmarks/checkpoint_drafters.py runs/c60 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from rl_exactness import signflip_p  # a sibling script: paired sign-flip p-value

from specroll.cli import common
from specroll.rl.config import from_dict
from specroll.rl.run import checkpoint
from specroll.rl.run.draft import build_draft
from specroll.rl.run.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a run directory (config.json, checkpoints/)")
    ap.add_argument("--checkpoint", type=Path, help="default: the run's latest")
    ap.add_argument("--step", type=int, help="first round's step (default: the checkpoint's)")
    ap.add_argument("--drafters", default="eagle3,history,history+eagle3")
    ap.add_argument("--repeats", type=int, default=5, help="counted rounds (after a warm-up)")
    args = ap.parse_args()
    ckpt = args.checkpoint or checkpoint.latest(args.run / "checkpoints")
    if not (args.run / "config.json").is_file() or ckpt is None:
        sys.exit(f"error: {args.run} is not a run directory with a checkpoint")
    if args.repeats < 1:
        sys.exit(f"error: --repeats must be >= 1, got {args.repeats}")
    problem = checkpoint.damage(ckpt)
    if problem:
        sys.exit(f"error: checkpoint {ckpt}: {problem}")
    names = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if not names:
        sys.exit("error: --drafters names no drafter")
    torch.set_num_threads(2)
    raw = json.loads((args.run / "config.json").read_text())
    raw["pipeline"]["out_dir"] = str(args.run)  # read only: nothing is written there
    # the drafters checked as the run's shadow drafters would be (names, parts, kind)
    shadows = {"shadow_drafters": names, "shadow_every": 1, "max_lag": 0}
    try:
        from_dict({**raw, "pipeline": {**raw["pipeline"], **shadows}})
    except ValueError as e:
        sys.exit(f"error: --drafters: {e}")
    cfg = from_dict(raw)
    path = common.resolve_model_dir(cfg.policy.model)
    policy, tok = common.load_dir(path)
    draft = build_draft(cfg, policy, tok, path)
    quiet = lambda _msg: None  # noqa: E731
    trainer = Trainer(cfg, policy, tok, draft, log=quiet)
    trainer.restore(checkpoint.load(ckpt))
    step = trainer.step if args.step is None else args.step
    ro = trainer.rollout
    before = ro.drafter_snapshot()
    own = cfg.rollout.drafter
    for name in names:
        if name != own:
            with ro.alternative(name, None):  # built (and profiled) outside the timing
                pass

    def generate(name: str, reqs: list) -> tuple[float, list, object]:
        if name == "plain":
            t0 = time.perf_counter()
            res = ro.generate_plain(reqs)
            return time.perf_counter() - t0, res, res.stats
        with ro.alternative(name, before) as alt:
            t0 = time.perf_counter()
            res = ro.generate(reqs) if name == own else alt(reqs)
            return time.perf_counter() - t0, res, res.stats

    order = ["plain", *names]
    runs: dict[str, list[tuple[int, float]]] = {n: [] for n in order}  # (tokens, seconds)
    tpi: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(args.repeats + 1):
        reqs = trainer.task.step_requests(step + rnd - 1)
        for name in order if rnd % 2 == 0 else order[::-1]:
            seconds, res, stats = generate(name, reqs)
            tokens = sum(len(r.token_ids) for r in res)
            if rnd:
                runs[name].append((tokens, seconds))
                if name != "plain":
                    tpi[name].append(stats.tokens_per_target_forward)
            rnd_s = f"round {rnd}/{args.repeats}"
            print(f"{rnd_s} {name}: {tokens / seconds:.1f} tok/s", file=sys.stderr, flush=True)

    def rate(xs: list[tuple[int, float]]) -> float:
        return sum(t for t, _ in xs) / sum(s for _, s in xs)

    logs = {n: [math.log(t / s) for t, s in xs] for n, xs in runs.items()}  # per round
    plain = runs["plain"]
    out = {}
    for name in names:
        ratios = [math.exp(a - b) for a, b in zip(logs[name], logs["plain"], strict=True)]
        out[name] = {
            "speedup": round(rate(runs[name]) / rate(plain), 4),
            "speedup_median": round(statistics.median(ratios), 4),
            "speedup_min": round(min(ratios), 4),
            "speedup_max": round(max(ratios), 4),
            "p_vs_plain": round(signflip_p(logs[name], logs["plain"]), 4),
            "tokens_per_target_forward": round(statistics.median(tpi[name]), 4),
        }
    own_vs = {  # the run's drafter against each other one: its rate over theirs
        other: {
            "ratio": round(rate(runs[own]) / rate(runs[other]), 4),
            "p": round(signflip_p(logs[own], logs[other]), 4),
        }
        for other in names
        if own in names and other != own
    }
    print(
        json.dumps(
            {
                "bench": "checkpoint_drafters",
                "config": {
                    "run": str(args.run),
                    "checkpoint": str(ckpt),
                    "steps": [step, step + args.repeats - 1],
                    "requests_per_round": len(reqs),
                    "repeats": args.repeats,
                    "run_drafter": own,
                },
                "plain_tok_s": round(rate(plain), 2),
                "drafters": out,
                "run_drafter_vs": own_vs,
            }
        )
    )


if __name__ == "__main__":
    main()
