"""RL-level exactness: speculative and plain rollouts give statistically identical runs.

The `tiny` preset, seeds 0..S-1, each run twice (rollout.speculative true / false) for N
steps with the online draft on. Lossless speculation means every sampled token has the
policy's distribution, so the two arms are draws from the same distribution of training
runs. Tests (each can fail). The unit of the primary test is the *run* (samples within a run
are clustered: the arms train along different sample paths):
  * run-level exact permutation test: per-run mean reward and mean response length,
    all C(2S, S) assignments of the 2S runs to the two arms;
Secondary, per-sample / per-step (anti-conservative under clustering; reported only):
  * per-sample response lengths pooled over all steps and seeds: difference of means,
    labels permuted between arms;
  * per-step reward and mean response length, paired by (seed, step): mean paired
    difference, signs flipped at random;
  * engine log-probs equal the learner's recomputation to 1e-5 at every step (both arms).
Prints one JSON line.  Run: python benchmarks/rl_exactness.py --seeds 3 --steps 30
(`--drafter history+draft --pool 8`: the history and combined drafters, prompts recurring).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from itertools import combinations

import torch

from specroll.model import load_model
from specroll.model.hub import resolve
from specroll.model.tokenizer import Tokenizer
from specroll.rl.config import build_config
from specroll.rl.run.draft import build_draft
from specroll.rl.run.trainer import Trainer


def run(seed: int, speculative: bool, steps: int, out: str, drafter: str, pool: int) -> dict:
    d = resolve("tiny")
    policy, tok = load_model(d), Tokenizer(d)
    cfg = build_config(
        "tiny",
        [
            f"pipeline.seed={seed}",
            f"pipeline.steps={steps}",
            f"pipeline.out_dir={out}",
            f"rollout.speculative={str(speculative).lower()}",
            f"rollout.drafter={drafter}",
            f"data.pool={pool}",
            "data.val_size=0",
            "pipeline.checkpoint_every=0",
        ],
    )
    t = Trainer(cfg, policy, tok, build_draft(cfg, policy, tok, d), log=lambda m: None)
    lengths: list[int] = []
    generate = t.rollout.engine.generate

    def spy(reqs, *a, **k):
        res = generate(reqs, *a, **k)
        lengths.extend(len(r.token_ids) for r in res)
        return res

    t.rollout.engine.generate = spy
    rows = [t.run_step() for _ in range(steps)]
    return {"lengths": lengths, "rows": rows}


def perm_p(a: list[float], b: list[float], n: int = 20000) -> float:
    """Two-sided permutation p-value of mean(a) - mean(b)."""
    x = torch.tensor(a + b, dtype=torch.float64)
    obs = abs(x[: len(a)].mean() - x[len(a) :].mean())
    g = torch.Generator().manual_seed(0)
    idx = torch.argsort(torch.rand(n, len(x), generator=g), dim=1)
    xs = x[idx]
    d = (xs[:, : len(a)].mean(1) - xs[:, len(a) :].mean(1)).abs()
    return float(((d >= obs - 1e-12).sum() + 1) / (n + 1))


def signflip_p(a: list[float], b: list[float], n: int = 20000) -> float:
    """Two-sided paired sign-flip p-value of mean(a - b)."""
    d = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    if not bool(d.any()):
        return 1.0
    g = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (n, len(d)), generator=g).double() * 2 - 1
    null = (signs * d).mean(1).abs()
    return float(((null >= d.mean().abs() - 1e-12).sum() + 1) / (n + 1))


def run_level_p(a: list[float], b: list[float]) -> float:
    """Exact two-sided permutation p-value of mean(a) - mean(b) over all label splits
    (`options_p` of two groups: with the pooled values fixed, the between-group sum of
    squares grows with |mean(a) - mean(b)|)."""
    return options_p([a, b])


def _between(groups: list[list[float]]) -> float:
    """sum_g n_g * mean_g^2: with the pooled values fixed, ordered as the between-group
    sum of squares (and as the one-way F statistic)."""
    return sum(sum(g) ** 2 / len(g) for g in groups)


def options_p(groups: list[list[float]]) -> float:
    """Exact permutation p-value that several groups of run means differ at all: the
    between-group sum of squares over every assignment of the pooled runs to groups of
    the same sizes (one test of all options, where pairwise tests of few runs cannot
    reach 0.05; e.g. 4 groups of 3: 369,600 assignments)."""
    x = [v for g in groups for v in g]
    sizes = [len(g) for g in groups]
    obs = _between(groups)
    hits = total = 0

    def assign(left: list[int], k: int, chosen: list[list[float]]) -> None:
        nonlocal hits, total
        if k == len(sizes) - 1:
            total += 1
            hits += _between([*chosen, [x[i] for i in left]]) >= obs - 1e-12
            return
        for idx in combinations(left, sizes[k]):
            rest = [i for i in left if i not in idx]
            assign(rest, k + 1, [*chosen, [x[i] for i in idx]])

    assign(list(range(len(x))), 0, [])
    return hits / total


def blocked_p(table: list[list[float]]) -> float:
    """Exact permutation p-value that options differ, blocked by seed: `table[s][o]` is
    option o's run mean at seed s, and the labels permute within each seed only (the
    seed fixes the prompts and the sampling stream, which move every option's reward
    together: the spread between seeds need not hide a difference between options)."""
    from itertools import permutations, product

    n_opt = len(table[0])

    def stat(rows: list[tuple[float, ...]]) -> float:
        return sum(sum(r[o] for r in rows) ** 2 for o in range(n_opt))

    obs = stat([tuple(r) for r in table])
    per_seed = [list(permutations(r)) for r in table[1:]]  # the first seed's labels fixed
    hits = total = 0
    for rows in product(*per_seed):
        total += 1
        hits += stat([tuple(table[0]), *rows]) >= obs - 1e-12
    return hits / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--drafter", default="eagle3", help="rollout.drafter of the speculative arm")
    ap.add_argument("--pool", type=int, default=0, help="data.pool (0: fresh prompts each step)")
    args = ap.parse_args()
    try:  # a bad --drafter / --pool: one line now, not a traceback after the first run
        build_config("tiny", [f"rollout.drafter={args.drafter}", f"data.pool={args.pool}"])
    except ValueError as e:
        raise SystemExit(str(e)) from None
    torch.set_num_threads(2)
    t0 = time.time()
    arms = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for spec in (True, False):
                arms[spec].append(
                    run(seed, spec, args.steps, f"{tmp}/{seed}-{spec}", args.drafter, args.pool)
                )
                arm = "speculative" if spec else "plain"
                print(f"seed {seed} {arm}: {args.steps} steps done", file=sys.stderr, flush=True)
    pooled = {s: [x for r in arms[s] for x in r["lengths"]] for s in arms}
    len_p = perm_p([float(x) for x in pooled[True]], [float(x) for x in pooled[False]])
    per = {
        key: (
            [row[key] for r in arms[True] for row in r["rows"]],
            [row[key] for r in arms[False] for row in r["rows"]],
        )
        for key in ("reward", "response_len_mean")
    }
    paired = {key: signflip_p(a, b) for key, (a, b) in per.items()}
    run_means = {
        key: {
            s: [sum(row[key] for row in r["rows"]) / len(r["rows"]) for r in arms[s]] for s in arms
        }
        for key in ("reward", "response_len_mean")
    }
    run_p = {key: run_level_p(v[True], v[False]) for key, v in run_means.items()}
    mismatch = max(
        row.get("logprob_mismatch_max") or 0.0 for s in arms for r in arms[s] for row in r["rows"]
    )
    als = [
        row["acceptance_length"]
        for r in arms[True]
        for row in r["rows"]
        if row["acceptance_length"]
    ]
    print(
        json.dumps(
            {
                "bench": "rl_exactness",
                "preset": "tiny",
                "seeds": args.seeds,
                "steps": args.steps,
                "drafter": args.drafter,
                "pool": args.pool,
                "samples_per_arm": len(pooled[True]),
                "mean_len": {
                    "spec": sum(pooled[True]) / len(pooled[True]),
                    "ar": sum(pooled[False]) / len(pooled[False]),
                },
                "mean_reward": {
                    "spec": sum(per["reward"][0]) / len(per["reward"][0]),
                    "ar": sum(per["reward"][1]) / len(per["reward"][1]),
                },
                "run_level_p": run_p,
                "run_means": run_means,
                "lengths_perm_p": len_p,
                "paired_signflip_p": paired,
                "logprob_mismatch_max": mismatch,
                "acceptance_length_mean": sum(als) / max(len(als), 1),
                "wall_s": round(time.time() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
