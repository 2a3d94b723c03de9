"""Project measured drafter acceptance onto the paper's 8B RL setting (Qwen3-8B GRPO on
32 GB200, presets paper-8b-rl-zero / paper-8b-rl-think): generation and step speed-up
over plain decoding, per drafter, early and late in training.

Acceptance (tokens per iteration at each draft size) carries over from the policy it was
measured on (`benchmarks/history_acceptance.py`); the cost is the preset's calibrated
step model, times the measured tree verify overhead (`benchmarks/tree_verify_cost.py`),
plus the host's drafting time. See `specroll.sim.measured` for how each drafter is
costed. Input (--acceptance FILE), JSON:

    {"early": {"eagle3": {"1": tau, ...}, "history": {"1": tau, ...},
               "history+eagle3": {...}},
     "late": {...},
     "tree_overhead": 1.3,          # tree of n nodes / chain of n + 1 tokens, verify
     "tree_fixed_ms": 20,           # the tree path's time per iteration beyond that
     "draft_ms": {"history": 0.5}}  # host drafting ms per row per iteration

'eagle3' is a chain (tau per draft depth k; or a list of per-position alphas), the others
are trees (tau per node budget n). Without --acceptance, EXAMPLE below is used: made-up
numbers of a plausible shape, NOT measurements. --sweep prints the speed-up against
tau(n) of the history drafter at one size n (its table's shape over sizes scaled to that
value), to show what acceptance the 8B setting needs for 1.3x. Prints tables and a final
JSON line with every figure and the configuration.

    python benchmarks/sim_history.py --acceptance scratch/acceptance.json --sweep
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specroll.sim.measured import EAGLE_DEPTH, gpu_costs, project
from specroll.sim.presets import preset
from specroll.sim.rollout import Speculation

HISTORY_EARLY = {0: 1.0, 1: 1.3, 2: 1.45, 4: 1.6, 8: 1.8, 16: 1.95, 32: 2.05, 64: 2.1}
EXAMPLE = {
    "early": {
        "eagle3": {1: 1.75, 2: 2.3, 3: 2.7, 5: 3.1, 7: 3.3},
        "history": HISTORY_EARLY,
        "history+eagle3": {1: 1.8, 2: 2.35, 4: 2.8, 8: 3.1, 16: 3.3, 32: 3.4, 64: 3.45},
    },
    "late": {
        "eagle3": {1: 1.7, 2: 2.2, 3: 2.55, 5: 2.9, 7: 3.05},
        "history": {1: 1.5, 2: 1.8, 4: 2.2, 8: 2.6, 16: 2.9, 32: 3.1, 64: 3.2},
        "history+eagle3": {1: 1.85, 2: 2.45, 4: 3.0, 8: 3.5, 16: 3.8, 32: 4.0, 64: 4.1},
    },
    "tree_overhead": 1.3,
    "draft_ms": {"history": 0.5},
}
"""EXAMPLE NUMBERS, NOT MEASUREMENTS: history acceptance grows late in training as the
policy's answers to a prompt converge; EAGLE-3 drifts down a little."""

SETTINGS = ("tree_overhead", "tree_fixed_ms", "draft_ms")
"""Keys of the input that are not phases."""

BASES = {"zero": ["paper-8b-rl-zero"], "think": ["paper-8b-rl-think"]}
BASES["both"] = BASES["zero"] + BASES["think"]


def load(path: str | None) -> tuple[dict, str]:
    """(config, its source) from --acceptance, or the example."""
    if path is None:
        return EXAMPLE, "built-in EXAMPLE numbers (not measurements)"
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw.get("tree_overhead", 1.0), (int, float)):
        raise SystemExit(f"{path}: tree_overhead must be a number")
    if not isinstance(raw.get("draft_ms", {}), dict):
        raise SystemExit(f"{path}: draft_ms must be an object {{drafter: ms per row}}")
    phases = [p for p in raw if p not in SETTINGS]
    bad = [p for p in phases if not isinstance(raw[p], dict) or not raw[p]]
    if not phases or bad:
        raise SystemExit(f"{path}: phases (e.g. early, late) must map drafters to tables: {bad}")
    return raw, path


def phases(cfg: dict) -> dict:
    return {p: v for p, v in cfg.items() if p not in SETTINGS}


def crossing(xs: list[float], ys: list[float], target: float) -> float | None:
    """The first x where y reaches `target` (linear between points), None if never."""
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        if y >= target:
            if i == 0:
                return x
            x0, y0 = xs[i - 1], ys[i - 1]
            return x0 + (target - y0) / (y - y0) * (x - x0)
    return None


def scaled(shape: dict[int, float], size: int, tau: float) -> dict[int, float]:
    """`shape` with its excess over 1 scaled so that tau(size) = tau (each tau(n) capped at
    n + 1, all a tree of n nodes can emit): the adaptive policy keeps the small sizes that
    pay at large batches, which a table of one size would not have."""
    base = Speculation.measured(dict(sorted((int(n), float(t)) for n, t in shape.items())))
    f = (tau - 1) / max(base.tau(size) - 1, 1e-9)
    return {n: min(1 + f * (t - 1), n + 1) for n, t in base.taus.items()}


def sweep(cfg: dict, base: str, size: int, taus: list[float], host_ms: float) -> dict:
    """Speed-ups of the history drafter at each tau(size), the first phase's history table
    (or the example's) giving the shape over sizes, with the configured host drafting time
    and with none."""
    shape = next(iter(phases(cfg).values())).get("history", HISTORY_EARLY)
    overhead, rows = float(cfg.get("tree_overhead", 1.0)), {"tau": taus}
    fixed = float(cfg.get("tree_fixed_ms", 0.0))
    for label, ms in (("", host_ms), ("_host0", 0.0)):
        res = [
            project(
                {"history": scaled(shape, size, t)},
                overhead,
                {"history": ms},
                base,
                tree_fixed_ms=fixed,
            )
            for t in taus
        ]
        rows[f"gen{label}"] = [round(r["history"]["gen_speedup"], 3) for r in res]
        rows[f"step{label}"] = [round(r["history"]["step_speedup"], 3) for r in res]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--acceptance", help="JSON file (format above); default: EXAMPLE")
    ap.add_argument("--base", choices=sorted(BASES), default="both", help="paper workload(s)")
    ap.add_argument("--eagle-depth", type=int, default=EAGLE_DEPTH)
    ap.add_argument("--sweep", action="store_true", help="speed-up vs tau at --sweep-size")
    ap.add_argument("--sweep-size", type=int, default=16, help="node budget n of the sweep")
    ap.add_argument("--sweep-taus", default="1.1,1.2,1.3,1.4,1.5,1.6,1.8,2,2.25,2.5,3,3.5,4")
    ap.add_argument("--target", type=float, default=1.3, help="speed-up the sweep solves for")
    ap.add_argument(
        "--gpu-check",
        help="benchmarks/gpu_check.py's JSON: its measured tree costs replace the input's "
        "tree_overhead and tree_fixed_ms (`specroll.sim.measured.gpu_costs`)",
    )
    ap.add_argument("--gpu-shape", default="qwen3-8b", help="the gpu_check shape to take")
    ap.add_argument("--gpu-eager", action="store_true", help="its rows without CUDA graphs")
    args = ap.parse_args()
    cfg, source = load(args.acceptance)
    if args.gpu_check:
        try:  # the report is gpu_check.py's last line (its --out file, or its stdout)
            report = json.loads(Path(args.gpu_check).read_text().strip().splitlines()[-1])
            costs = gpu_costs(report, args.gpu_shape, graphs=not args.gpu_eager)
        except (OSError, IndexError, ValueError, AttributeError) as e:
            raise SystemExit(f"--gpu-check {args.gpu_check}: {e}") from None
        cfg = cfg | {k: costs[k] for k in ("tree_overhead", "tree_fixed_ms")}
        source += f"; tree costs: {args.gpu_check} ({args.gpu_shape}, {report.get('device_name')})"
    overhead, draft_ms = float(cfg.get("tree_overhead", 1.0)), cfg.get("draft_ms", {})
    fixed = float(cfg.get("tree_fixed_ms", 0.0))
    print(
        f"acceptance: {source}; tree_overhead {overhead}; tree fixed {fixed} ms/iter; "
        f"host draft ms/row {draft_ms}"
    )
    results, reference, sweeps = {}, {}, {}
    for base in BASES[args.base]:
        paper = preset(base).run()  # the paper's own EAGLE-3, fixed k = 3: the calibration
        reference[base] = {k: round(paper[k], 3) for k in ("gen_speedup", "step_speedup")}
        print(
            f"\n{base}  (paper EAGLE-3 k=3 fixed, simulated: gen {paper['gen_speedup']:.2f}x,"
            f" step {paper['step_speedup']:.2f}x)"
        )
        print(f"{'phase':>6} {'drafter':>16} {'gen x':>6} {'step x':>6}  sizes used (share)")
        results[base] = {}
        for phase, acc in phases(cfg).items():
            res = project(acc, overhead, draft_ms, base, args.eagle_depth, fixed)
            results[base][phase] = {
                d: {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                for d, r in res.items()
            }
            for d, r in res.items():
                top = sorted(r["sizes"].items(), key=lambda kv: -kv[1])[:4]
                used = " ".join(f"{n}:{s:.0%}" for n, s in top)
                gx, sx = r["gen_speedup"], r["step_speedup"]
                print(f"{phase:>6} {d:>16} {gx:6.2f} {sx:6.2f}  {used}")
        if args.sweep:
            taus = [float(x) for x in args.sweep_taus.split(",")]
            host = draft_ms.get("history", 0.0)
            s = sweeps[base] = sweep(cfg, base, args.sweep_size, taus, host)
            print(
                f"\nsweep: history tree, tau(n) at n = {args.sweep_size} (the table's shape "
                f"scaled), tree_overhead {overhead}, host {host} ms/row (and 0)"
            )
            print(f"{'tau(n)':>7} {'gen x':>6} {'step x':>6} {'gen x h0':>9} {'step x h0':>9}")
            for i, t in enumerate(taus):
                print(
                    f"{t:7.2f} {s['gen'][i]:6.2f} {s['step'][i]:6.2f} "
                    f"{s['gen_host0'][i]:9.2f} {s['step_host0'][i]:9.2f}"
                )
            need = {k: crossing(taus, s[k], args.target) for k in list(s)[1:]}
            s["tau_needed"] = {k: None if v is None else round(v, 3) for k, v in need.items()}
            print(
                f"tau({args.sweep_size}) needed for {args.target}x (None: not within the "
                f"sweep): {s['tau_needed']}"
            )
    out = {
        "bench": "sim_history",
        "source": source,
        "config": {
            "tree_overhead": overhead,
            "tree_fixed_ms": fixed,
            "draft_ms_per_row": draft_ms,
            "eagle_depth": args.eagle_depth,
            "acceptance": phases(cfg),
            "sweep": {"size": args.sweep_size, "target": args.target} if args.sweep else None,
        },
        "reference_paper_eagle3_k3": reference,
        "results": results,
        "sweep": sweeps or None,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
