"""How a run's draft starts, compared on finished runs (issue 47): offline in-domain draft,
online bootstrap from the policy's weights or at random, history only.

Reads the `metrics.jsonl` of runs of the same preset and seeds that differ in their start
(`NAME=RUN_DIR[@BUILD_S]`, BUILD_S: seconds spent before the run on building its draft,
e.g. the offline draft's 23 minutes; a run's own start-up is in its first step's time).
Per step and option:
* the draft's expected acceptance per position (`draft_accept`, the learner's sum of
  min(p, q) on the step's rollouts, with the draft as it drafted them) and the chain
  acceptance length it implies at k = 3, tau = 1 + a1 + a1 a2 + a1 a2 a3: a figure of the
  draft itself, whether or not the depth policy chose to draft (on a CPU it mostly does
  not);
* the measured acceptance length where it drafted, `gen_rate_speedup` on shadow steps;
* reward, validation accuracy, and wall clock (build + the steps' `step_s`).
Then: the step at which each bootstrapped draft first reaches the offline draft's
acceptance (its median over the steps; the bootstrapped draft's as a median of the last
`WINDOW` steps), and the gap over the last `WINDOW` steps; wall clock to the
best validation accuracy every option reaches; reward differences: per step, paired by
step, sign-flip test (samples within a run are clustered: an indication); with several
runs of an option (one NAME given several times, a seed each), the run-level test: the
exact permutation test of the runs' mean rewards between every two options
(`rl_exactness.run_level_p`), and of all options at once (`options_p`: few runs per option
cannot reach 0.05 pairwise; `blocked_p` over the seeds every option ran: labels
permuted within a seed, whose prompts and sampling stream move all options together);
a plot (`--plot FILE`).

With several runs per option, the per-step figures (acceptance, reach, gap) are the mean
over its runs at each step, wall clock to the validation target the median of its runs.

Prints one JSON line.  Run:
  python benchmarks/start_options.py offline=runs/o@1380 policy=runs/p random=runs/r \
      history=runs/h [policy=runs/p-seed1 ...] --plot start_options.png
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_io import Parser, fail, metrics_rows, output, run_config, run_spec  # noqa: E402
from rl_exactness import blocked_p, options_p, run_level_p, signflip_p  # noqa: E402

K = 3
"""Chain depth at which the draft's acceptance length is reported."""
WINDOW = 5
"""Steps over which a draft's acceptance length is taken as a median (reach, gap)."""


def tau(accept: list[float], k: int = K) -> float:
    """Chain acceptance length at depth k from per-position acceptance rates."""
    out, run = 1.0, 1.0
    for a in accept[:k]:
        run *= a
        out += run
    return out


def read_run(spec: str) -> tuple[str, dict]:
    """NAME=DIR[@BUILD_S] → (name, per-run figures)."""
    name, path, build = run_spec(spec, seconds=True)
    rows = metrics_rows(path)
    steps = [m for m in rows if "reward" in m]
    if not steps:
        fail(f"{spec!r}: {path / 'metrics.jsonl'} has no training step yet")
    val = {m["step"]: m["val_accuracy"] for m in rows if m.get("val_accuracy") is not None}
    clock, t = {0: build}, build  # wall clock at the end of each step (step 0: the start)
    for m in steps:
        t += m.get("step_s", 0.0)
        clock[m["step"]] = round(t, 1)
    return name, {
        "build_s": build,
        "steps": [m["step"] for m in steps],
        "reward": [m["reward"] for m in steps],
        "draft_accept": [m.get("draft_accept") for m in steps],
        "draft_tau": [
            round(tau(a), 4) if a else None for a in (m.get("draft_accept") for m in steps)
        ],
        "acceptance_length": [m.get("acceptance_length") for m in steps],
        "gen_rate_speedup": {
            m["step"]: m["gen_rate_speedup"] for m in steps if "gen_rate_speedup" in m
        },
        "val_accuracy": val,
        "clock_s": clock,
        "seed": run_config(path).get("pipeline", {}).get("seed"),
    }


def _paired(a: list[float], b: list[float]) -> tuple[list[float], list[float]]:
    n = min(len(a), len(b))
    return a[:n], b[:n]


def rolling(xs: list[float | None], w: int = WINDOW) -> list[float | None]:
    """Median of the last `w` steps' values (None until there are `w` of them)."""
    out: list[float | None] = []
    for i in range(len(xs)):
        seen = [x for x in xs[max(0, i - w + 1) : i + 1] if x is not None]
        out.append(statistics.median(seen) if len(seen) == w else None)
    return out


def reach(run: dict, target: float) -> int | None:
    """First step whose draft acceptance length, as the median of the last `WINDOW`
    steps (one step's is noisy: 64 short answers), reaches `target`."""
    for s, t in zip(run["steps"], rolling(run["draft_tau"]), strict=True):
        if t is not None and t >= target:
            return s
    return None


def _mean_run(group: list[dict]) -> dict:
    """One run of an option as the per-step mean of its runs (the steps all share)."""
    if len(group) == 1:
        return group[0]
    n = min(len(r["steps"]) for r in group)

    def mean(key: str) -> list[float | None]:
        cols = [[r[key][i] for r in group] for i in range(n)]
        return [None if None in c else statistics.mean(c) for c in cols]

    return {
        **group[0],
        "steps": group[0]["steps"][:n],
        "reward": mean("reward"),
        "draft_tau": mean("draft_tau"),
        "acceptance_length": mean("acceptance_length"),
    }


def main() -> None:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="NAME=RUN_DIR[@BUILD_S]")
    ap.add_argument("--reference", default="offline", help="the option others are measured against")
    ap.add_argument("--plot", type=output, help="write the per-step plot here (PNG)")
    args = ap.parse_args()
    groups: dict[str, list[dict]] = {}
    for spec in args.runs:
        name, run = read_run(spec)
        groups.setdefault(name, []).append(run)
    runs = {n: _mean_run(g) for n, g in groups.items()}
    ref = runs.get(args.reference)
    out: dict = {"k": K, "runs": groups}
    if ref is not None and any(t is not None for t in ref["draft_tau"]):
        target = statistics.median(t for t in ref["draft_tau"] if t is not None)
        out["reference_tau"] = round(target, 4)
        out["reaches_reference_at_step"] = {
            n: reach(r, target) for n, r in runs.items() if n != args.reference
        }
        out["gap_at_last_steps"] = {
            n: round(target - last, 4)
            for n, r in runs.items()
            if n != args.reference and (last := rolling(r["draft_tau"])[-1]) is not None
        }
    # wall clock to the best validation accuracy every run reaches (median per option)
    every = [r for g in groups.values() for r in g]
    common = min(max(r["val_accuracy"].values(), default=0.0) for r in every)

    def to_val(r: dict) -> float | None:
        step = next((s for s, a in sorted(r["val_accuracy"].items()) if a >= common), None)
        return None if step is None else r["clock_s"].get(step)

    to_acc = {}
    for n, g in groups.items():
        times = [to_val(r) for r in g]
        to_acc[n] = None if None in times else statistics.median(times)
    out["val_target"], out["wall_s_to_val_target"] = common, to_acc
    if all(len(g) > 1 for g in groups.values()):
        run_means = {n: [statistics.mean(r["reward"]) for r in g] for n, g in groups.items()}
        out["run_mean_rewards"] = {n: [round(x, 4) for x in v] for n, v in run_means.items()}
        options = list(groups)
        out["reward_run_level_p"] = {
            f"{a}~{b}": round(run_level_p(run_means[a], run_means[b]), 4)
            for i, a in enumerate(options)
            for b in options[i + 1 :]
        }
        out["reward_options_p"] = round(options_p(list(run_means.values())), 5)
        # blocked by seed over the seeds every option ran (two at least)
        by_seed = {
            n: dict(zip((r["seed"] for r in g), run_means[n], strict=True))
            for n, g in groups.items()
        }
        common = sorted(set.intersection(*(set(v) for v in by_seed.values())) - {None})
        if len(common) > 1:
            table = [[by_seed[n][s] for n in groups] for s in common]
            out["reward_options_blocked_p"] = round(blocked_p(table), 5)
            out["blocked_seeds"] = common
    names = list(runs)
    out["reward_signflip_p"] = {
        f"{a}~{b}": round(signflip_p(*_paired(runs[a]["reward"], runs[b]["reward"])), 4)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    means = {n: statistics.mean(r["reward"]) for n, r in runs.items()}
    out["mean_reward"] = {n: round(v, 4) for n, v in means.items()}
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
        for n, r in runs.items():
            pts = [(s, t) for s, t in zip(r["steps"], r["draft_tau"], strict=True) if t is not None]
            if pts:
                ax1.plot(*zip(*pts, strict=True), label=n)
            else:  # no network (history): the acceptance length measured where it drafted
                al = r["acceptance_length"]
                pts = [(s, a) for s, a in zip(r["steps"], al, strict=True) if a is not None]
                if pts:
                    ax1.plot(*zip(*pts, strict=True), "--", label=f"{n} (measured)")
            ax2.plot(r["steps"], r["reward"], label=n, alpha=0.8)
        ax1.set_ylabel(f"draft acceptance length (chain, k = {K})")
        ax1.legend()
        ax2.set_ylabel("reward")
        ax2.set_xlabel("step")
        ax2.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
