"""What speculation can buy on this machine: a run's measured acceptance and this
machine's cost profiles in the simulator's rollout (`specroll.sim`), per late step of
the run (its own response lengths), beside the speed-up the run measured there; and the
ceiling with every draft accepted (tau(n) = n + 1) at the same costs.

The acceptance is `benchmarks/shadow_drafters.py RUN --acceptance-out FILE` (tokens per
row-iteration at each draft size, per drafter, early and late); the costs are the cached
hardware profiles of each drafter (`specroll bench profile`, measured at a run's start),
whose tree terms price a tree of n nodes. Also prints, per batch size, the best
tokens-per-cost ratio over the measured sizes and the ceiling's: on a machine where a
verified token costs nearly a plain iteration's token (compute-bound), it stays low.

    python benchmarks/speedup_ceiling.py runs/c60 --acceptance scratch/acc_c60.json

Prints a table and a final JSON line with every figure and the configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_io import metrics_rows  # noqa: E402

from specroll.engine.costmodel import CostModel
from specroll.model.hub import home
from specroll.sim.presets import preset
from specroll.sim.rollout import Speculation, TreeCost

OLD_SHADOW_NAME = {"eagle3": "draft", "mtp": "draft"}
"""sim_history's network names -> a shadow drafter's name in runs from before
rollout.drafter named the network (since, they are the same)."""


def speculation(name: str, taus: dict[int, float], cm: CostModel) -> Speculation:
    """A chain for the network alone, a tree (priced by the profile's tree terms and its
    drafter's fitted draft time at n) otherwise."""
    if name in ("eagle3", "mtp"):
        return Speculation.measured(taus)
    return Speculation.measured(taus, TreeCost(fixed_s=cm.tree_fixed, model_depth=1 << 10))


def profile_of(name: str, where: Path) -> Path:
    """The newest cached profile of this drafter."""
    found = sorted(where.glob(f"*-{name}.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no profile *-{name}.json under {where}: run `specroll bench profile`")
    return found[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a run's out_dir (metrics.jsonl, config.json)")
    ap.add_argument("--acceptance", required=True, help="shadow_drafters --acceptance-out")
    ap.add_argument("--phase", default="late", help="phase of the acceptance file")
    ap.add_argument("--late", type=int, default=20, help="last steps simulated")
    ap.add_argument("--prompt-len", type=int, default=42, help="mean prompt tokens")
    ap.add_argument("--profiles", default="", help="profile directory (default: the cache)")
    args = ap.parse_args()
    root = Path(args.run)
    for f in (root / "metrics.jsonl", root / "config.json", Path(args.acceptance)):
        if not f.is_file():
            raise SystemExit(f"{f}: no such file")
    lines = metrics_rows(root)
    cfg = json.loads((root / "config.json").read_text())
    phases = json.loads(Path(args.acceptance).read_text())
    if not isinstance(phases.get(args.phase), dict):
        have = [p for p, v in phases.items() if isinstance(v, dict) and p != "draft_ms"]
        raise SystemExit(f"--phase {args.phase}: not in {args.acceptance} (it has {have})")
    acc = phases[args.phase]
    drafter = cfg["rollout"]["drafter"]  # runs before rollout.drafter named the network: draft.kind
    kind = cfg["draft"].get("kind") or drafter.removeprefix("history+")
    own = drafter.replace("draft", kind)
    where = Path(args.profiles) if args.profiles else home() / "profiles"
    last = max(m["step"] for m in lines)
    steps = [m for m in lines if m.get("response_lengths") and m["step"] > last - args.late]

    sim = preset("paper-8b-rl-zero")
    sim.cluster = replace(
        sim.cluster, gpus=1, gen_gpus=0, gen_tp=1, gen_ep=1, max_seqs=cfg["rollout"]["max_batch"]
    )
    per_step = cfg["data"]["prompts_per_step"]
    sim.workload = replace(
        sim.workload,
        prompts=per_step,
        samples=cfg["data"]["group_size"],
        prompt_len=args.prompt_len,
    )
    out, bounds = {}, {}
    for name, table in acc.items():
        taus = {int(n): float(t) for n, t in table.items()}
        path = profile_of(name, where)
        cm = CostModel.load(path)
        sim.step = cm
        spec = speculation(name, taus, cm)
        # the ceiling may use any size the run could (rollout.k for a chain, nodes for trees)
        k = cfg["rollout"]["k"] if name in ("eagle3", "mtp") else cfg["rollout"]["nodes"]
        # (the best over the largest size allowed: a row's draft does not know where its
        # response stops, so a deep perfect draft still runs past the end of short ones)
        caps = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= k]
        perfect = [speculation(name, {n: n + 1.0 for n in range(1, c + 1)}, cm) for c in caps]
        ceiling = perfect[-1]
        pred, top = [], []
        for m in steps:
            lengths = m["response_lengths"]
            plain = sim.generation(Speculation(), lengths)["gen_s"]
            pred.append(plain / sim.generation(spec, lengths)["gen_s"])
            top.append(max(plain / sim.generation(p, lengths)["gen_s"] for p in perfect))
        key = "gen_rate_speedup" if name == own else f"shadow/{name}/gen_rate_speedup"
        old = f"shadow/{OLD_SHADOW_NAME.get(name, name)}/gen_rate_speedup"
        measured = [m[key] if key in m else m[old] for m in steps if key in m or old in m]
        out[name] = {
            "profile": str(path),
            "taus": taus,
            "predicted_median": round(statistics.median(pred), 3),
            "measured_median": round(statistics.median(measured), 3) if measured else None,
            "measured": measured,
            "ceiling_median": round(statistics.median(top), 3),
        }
        bounds[name] = {}
        for B in (1, 4, 16, 32):
            base = cm.iteration(B, 0, args.prompt_len + 20)
            best = max(taus[n] * base / spec.time(cm, B, n, args.prompt_len + 20) for n in taus)
            perfect = max(
                (n + 1) * base / ceiling.time(cm, B, n, args.prompt_len + 20)
                for n in range(1, k + 1)
            )
            bounds[name][B] = {
                "measured_taus": round(best, 3),
                "every_draft_accepted": round(perfect, 3),
            }

    print(f"steps {steps[0]['step']}..{steps[-1]['step']} of {root} ({len(steps)} steps)")
    print(f"{'drafter':>16} {'predicted':>9} {'measured':>9} {'ceiling':>8}")
    for name, r in out.items():
        meas = "-" if r["measured_median"] is None else f"{r['measured_median']:.3f}"
        print(f"{name:>16} {r['predicted_median']:9.3f} {meas:>9} {r['ceiling_median']:8.3f}")
    print("per batch size: best tau(n) x plain / cost(n), measured taus | all accepted")
    for name, per_b in bounds.items():
        cells = "  ".join(
            f"B{B}: {v['measured_taus']:.2f} | {v['every_draft_accepted']:.2f}"
            for B, v in per_b.items()
        )
        print(f"{name:>16}  {cells}")
    print(
        json.dumps(
            {
                "bench": "speedup_ceiling",
                "run": str(root),
                "phase": args.phase,
                "steps": [m["step"] for m in steps],
                "prompt_len": args.prompt_len,
                "drafters": out,
                "per_batch": bounds,
            }
        )
    )


if __name__ == "__main__":
    main()
