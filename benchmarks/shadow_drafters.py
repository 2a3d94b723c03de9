"""Per-step figures of every drafter of one run with `pipeline.shadow_drafters`: the run's
own drafter and each shadow drafter, measured on the same requests, weights, seeds and
history at every shadow step. Plots tokens per row-iteration, acceptance length and the
token-rate speed-up over plain decoding per step, and the mean reward of every drafter's
samples and of plain decoding's at each shadow step (same weights: they must agree;
paired sign-flip test of each drafter against plain over the shadow steps). Prints a
final JSON line: per drafter, the figures at each shadow step, their medians early
(first third of the steps) and late (last 20 steps), and whether the combined drafter
was at least the better of the other two at every shadow step.

    python benchmarks/shadow_drafters.py runs/h60 --out docs/figures/shadow_drafters.png

`--acceptance-out FILE` writes the early and late tokens per iteration at each draft size
(median over the phase's shadow steps, at the sizes all of them verified) in the input
format of `benchmarks/sim_history.py`, which projects them onto the paper's 8B setting;
the draft network is named by its kind (`draft` -> `eagle3`, `history+draft` ->
`history+eagle3`).

The first shadow step of a run made before the shadow engines were built outside the
timing (commit "shadow drafters: their engines ... outside the timed generation")
includes the shadow drafters' one-time cost profiles: `--skip-steps 1` leaves it out.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from rl_exactness import signflip_p  # a sibling script: paired sign-flip p-value

sys.path.insert(0, str(Path(__file__).parent))
from bench_io import Parser, metrics_rows, output, run_config  # noqa: E402

FIELDS = ("acceptance_length", "tokens_per_target_forward", "gen_rate_speedup", "reward")


def series(lines: list[dict], own: str) -> dict[str, dict[int, dict[str, float]]]:
    """{drafter: {step: {tokens_per_target_forward, acceptance_length, gen_rate_speedup}}}."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for m in lines:
        if "gen_rate_speedup" not in m:
            continue
        s = m["step"]
        out.setdefault(own, {})[s] = {
            "tokens_per_target_forward": m.get("tokens_per_target_forward"),
            "acceptance_length": m.get("acceptance_length"),
            "gen_rate_speedup": m["gen_rate_speedup"],
            "reward": m.get("reward"),
            "tau_at": m.get("tau_at"),
        }
        if "shadow_ar_reward" in m:
            out.setdefault("plain", {})[s] = {"reward": m["shadow_ar_reward"]}
        for key, v in m.items():
            if key.startswith("shadow/") and key.count("/") == 2:
                _, name, field = key.split("/")
                out.setdefault(name, {}).setdefault(s, {})[field] = v
    return out


def acceptance(
    data: dict, steps: dict[str, list[int]], kind: str
) -> dict[str, dict[str, dict[str, float]]]:
    """{phase: {drafter: {size: median tau}}} over each phase's steps (sim_history input)."""
    out: dict = {}
    for phase, which in steps.items():
        for name, by_step in data.items():
            tables = [by_step[s]["tau_at"] for s in which if (by_step.get(s) or {}).get("tau_at")]
            if not tables:
                continue
            # only the sizes every step verified: a larger one was verified only where the
            # adaptive policy chose it (small batches, the long tails), a biased sample;
            # medians of per-step tables that all rise with size rise with size
            sizes = sorted(set.intersection(*({int(n) for n in t} for t in tables)))
            med = {str(n): round(statistics.median(t[str(n)] for t in tables), 4) for n in sizes}
            out.setdefault(phase, {})[name.replace("draft", kind)] = med
    return out


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run's out_dir (its run/metrics.jsonl is read)")
    ap.add_argument("--out", type=output, default="", help="PNG to write")
    ap.add_argument("--skip-steps", default="", help="comma list of steps to leave out")
    ap.add_argument("--late", type=int, default=20, help="steps counted as late")
    ap.add_argument(
        "--acceptance-out", type=output, default="", help="sim_history input JSON to write"
    )
    ap.add_argument("--tree-fixed-ms", type=float, default=0.0, help="written with it")
    args = ap.parse_args()
    root = Path(args.run)
    path = root / "run" / "metrics.jsonl"
    if not path.is_file():
        path = root / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{root}: no metrics.jsonl (give a run's out_dir)")
    lines = metrics_rows(path.parent)
    own, kind = "run", "eagle3"
    if run_cfg := run_config(path.parent):
        own = run_cfg.get("rollout", {}).get("drafter", own)
        # runs before rollout.drafter named the network kept it in draft.kind
        kind = run_cfg.get("draft", {}).get("kind") or own.removeprefix("history+")
    skip = {int(x) for x in args.skip_steps.split(",") if x}
    data = series([m for m in lines if m.get("step") not in skip], own)
    steps = sorted({s for d in data.values() for s in d})
    last = max((m["step"] for m in lines), default=0)
    phase_steps = {
        "early": [s for s in steps if s <= last / 3],
        "late": [s for s in steps if s > last - args.late],
    }
    summary = {}
    for name, by_step in data.items():
        early = [by_step[s] for s in phase_steps["early"] if s in by_step]
        late = [by_step[s] for s in phase_steps["late"] if s in by_step]

        def med(rows: list[dict], field: str) -> float | None:
            xs = [r[field] for r in rows if r.get(field) is not None]
            return round(statistics.median(xs), 4) if xs else None

        summary[name] = {
            "steps": {s: by_step[s] for s in sorted(by_step)},
            "early": {f: med(early, f) for f in FIELDS},
            "late": {f: med(late, f) for f in FIELDS},
        }
    reward_p = {}
    if "plain" in data:
        for name, by_step in data.items():
            pairs = [
                (v["reward"], data["plain"][s]["reward"])
                for s, v in by_step.items()
                if name != "plain" and v.get("reward") is not None and s in data["plain"]
            ]
            if pairs:
                reward_p[name] = {
                    "steps": len(pairs),
                    "mean_diff": round(statistics.mean(a - b for a, b in pairs), 4),
                    "signflip_p": round(signflip_p(*map(list, zip(*pairs, strict=True))), 4),
                }
    others = [n for n in data if n not in (own, "plain")]
    best_every = None
    if others:
        best_every = {
            field: all(
                data[own][s][field] >= max(data[n][s].get(field, 0) for n in others)
                for s in steps
                if s in data[own] and all(s in data[n] for n in others)
            )
            for field in ("tokens_per_target_forward", "gen_rate_speedup")
        }
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 4, figsize=(20, 4))
        # one colour per drafter in every panel; shrinking markers keep equal values visible
        for i, (name, by_step) in enumerate(data.items()):
            xs = sorted(by_step)
            size = max(9 - 1.5 * i, 3)
            style = {"color": f"C{i}", "marker": "o", "markersize": size, "label": name}
            for ax, field in zip(axes, FIELDS, strict=True):
                ys = [by_step[s].get(field) for s in xs]
                if any(y is not None for y in ys):
                    ax.plot(xs, ys, **style)
                ax.set_title(field.replace("_", " "))
                ax.set_xlabel("step")
        axes[2].axhline(1.0, color="grey", lw=0.8)
        rs = [(m["step"], m["reward"]) for m in lines if "reward" in m]
        axes[3].plot(
            [s for s, _ in rs],
            [r for _, r in rs],
            color="black",
            lw=0.6,
            alpha=0.4,
            label="every step",
        )
        axes[3].set_title("reward of each drafter's samples (same weights)")
        axes[0].legend()
        axes[3].legend()
        fig.tight_layout()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=100)
    if args.acceptance_out:
        sim = acceptance(data, phase_steps, kind)
        sim |= {"tree_overhead": 1.0, "tree_fixed_ms": args.tree_fixed_ms, "draft_ms": {}}
        Path(args.acceptance_out).write_text(json.dumps(sim, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:>16}  early {s['early']}  late {s['late']}")
    print(
        json.dumps(
            {
                "bench": "shadow_drafters",
                "run": str(root),
                "own": own,
                "skipped_steps": sorted(skip),
                "late_steps": args.late,
                "combined_at_least_the_best_every_step": best_every,
                "reward_vs_plain": reward_p,
                "drafters": summary,
            }
        )
    )


if __name__ == "__main__":
    main()
