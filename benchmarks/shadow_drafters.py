"""Per-step figures of every drafter of one run with `pipeline.shadow_drafters`: the run's
own drafter and each shadow drafter, measured on the same requests, weights, seeds and
history at every shadow step. Plots tokens per row-iteration, acceptance length and the
token-rate speed-up over plain decoding per step (and the run's reward), and prints a
final JSON line: per drafter, the figures at each shadow step, their medians early
(first third of the steps) and late (last 20 steps), and whether the combined drafter
was at least the better of the other two at every shadow step.

    python benchmarks/shadow_drafters.py runs/h60 --out docs/figures/shadow_drafters.png

The first shadow step of a run made before the shadow engines were built outside the
timing (commit "shadow drafters: their engines ... outside the timed generation")
includes the shadow drafters' one-time cost profiles: `--skip-steps 1` leaves it out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

FIELDS = ("acceptance_length", "tokens_per_iter", "gen_rate_speedup")


def series(lines: list[dict], own: str) -> dict[str, dict[int, dict[str, float]]]:
    """{drafter: {step: {tokens_per_iter, acceptance_length, gen_rate_speedup}}}."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for m in lines:
        if "gen_rate_speedup" not in m:
            continue
        s = m["step"]
        out.setdefault(own, {})[s] = {
            "tokens_per_iter": m.get("tokens_per_iter"),
            "acceptance_length": m.get("acceptance_length"),
            "gen_rate_speedup": m["gen_rate_speedup"],
        }
        for key, v in m.items():
            if key.startswith("shadow/") and key.count("/") == 2:
                _, name, field = key.split("/")
                out.setdefault(name, {}).setdefault(s, {})[field] = v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run's out_dir (its run/metrics.jsonl is read)")
    ap.add_argument("--out", default="", help="PNG to write")
    ap.add_argument("--skip-steps", default="", help="comma list of steps to leave out")
    ap.add_argument("--late", type=int, default=20, help="steps counted as late")
    args = ap.parse_args()
    root = Path(args.run)
    path = root / "run" / "metrics.jsonl"
    if not path.is_file():
        path = root / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    cfg_path = path.parent / "config.json"
    own = "run"
    if cfg_path.is_file():
        own = json.loads(cfg_path.read_text()).get("rollout", {}).get("drafter", own)
    skip = {int(x) for x in args.skip_steps.split(",") if x}
    data = series([m for m in lines if m.get("step") not in skip], own)
    steps = sorted({s for d in data.values() for s in d})
    last = max((m["step"] for m in lines), default=0)
    summary = {}
    for name, by_step in data.items():
        early = [v for s, v in by_step.items() if s <= last / 3]
        late = [v for s, v in by_step.items() if s > last - args.late]

        def med(rows: list[dict], field: str) -> float | None:
            xs = [r[field] for r in rows if r.get(field) is not None]
            return round(statistics.median(xs), 4) if xs else None

        summary[name] = {
            "steps": {s: by_step[s] for s in sorted(by_step)},
            "early": {f: med(early, f) for f in FIELDS},
            "late": {f: med(late, f) for f in FIELDS},
        }
    others = [n for n in data if n != own]
    best_every = None
    if others:
        best_every = {
            field: all(
                data[own][s][field] >= max(data[n][s].get(field, 0) for n in others)
                for s in steps
                if s in data[own] and all(s in data[n] for n in others)
            )
            for field in ("tokens_per_iter", "gen_rate_speedup")
        }
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 4, figsize=(20, 4))
        fields = ("acceptance_length", "tokens_per_iter", "gen_rate_speedup")
        for name, by_step in data.items():
            xs = sorted(by_step)
            for ax, field in zip(axes[:3], fields, strict=True):
                ax.plot(xs, [by_step[s].get(field) for s in xs], marker="o", label=name)
                ax.set_title(field.replace("_", " "))
                ax.set_xlabel("step")
        axes[2].axhline(1.0, color="grey", lw=0.8)
        rs = [(m["step"], m["reward"]) for m in lines if "reward" in m]
        axes[3].plot([s for s, _ in rs], [r for _, r in rs], color="black")
        axes[3].set_title("reward (one run: the policy never sees the drafter)")
        axes[3].set_xlabel("step")
        axes[0].legend()
        fig.tight_layout()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=100)
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
                "drafters": summary,
            }
        )
    )


if __name__ == "__main__":
    main()
