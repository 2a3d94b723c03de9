"""Measured acceptance projected onto a preset: what a drafter measured on a small policy
would buy in the paper's 8B setting (`presets.PAPER`).

Acceptance (tokens per iteration at each draft size) is a property of the drafter and the
policy's outputs, not of the hardware, so it carries over from where it was measured;
what it costs is the preset's step model plus, for trees, the measured verify overhead
and host drafting time (`rollout.TreeCost`). Each drafter runs in the preset's sync
rollout with the adaptive size policy (per live batch size, the measured size with the
most tokens per second, 0 = plain), against plain decoding on the same workload.

* a list of per-position alphas, or a table under the name `eagle3`: a chain, costed as
  the preset's EAGLE-3 (one draft forward per token);
* any other table: a tree of n nodes, costed with `tree_overhead`, the tree path's
  fixed time per iteration `tree_fixed_ms` and the host drafting
  time `draft_ms` (per row per iteration: the drafter's own entry, else the sum of its
  '+'-separated parts' entries), plus the preset's EAGLE-3 draft of min(n, eagle_depth)
  tokens when the name contains 'eagle3'.
"""

from __future__ import annotations

import statistics

from specroll.sim.presets import preset
from specroll.sim.rollout import Speculation, TreeCost

EAGLE_DEPTH = 3
"""Draft tokens of the EAGLE-3 part of a merged tree drafter (the paper's k)."""


def drafter_spec(
    name: str,
    acceptance: dict[int, float] | list[float],
    tree_overhead: float,
    draft_ms: dict[str, float],
    eagle_depth: int = EAGLE_DEPTH,
    tree_fixed_ms: float = 0.0,
) -> Speculation:
    """The adaptive `Speculation` of one named drafter (see the module docstring)."""
    if isinstance(acceptance, list):
        return Speculation(k=len(acceptance), alphas=list(acceptance), adaptive=True)
    table = dict(sorted((int(n), float(t)) for n, t in acceptance.items()))  # JSON keys: str
    if name == "eagle3":
        return Speculation.measured(table)
    host_ms = draft_ms.get(name, sum(draft_ms.get(p, 0.0) for p in name.split("+")))
    cost = TreeCost(
        tree_overhead=tree_overhead,
        fixed_s=tree_fixed_ms * 1e-3,
        host_draft_s=host_ms * 1e-3,
        model_depth=eagle_depth if "eagle3" in name else 0,
    )
    return Speculation.measured(table, cost)


def project(
    acceptance: dict[str, dict[int, float] | list[float]],
    tree_overhead: float,
    draft_ms: dict[str, float],
    base: str = "paper-8b-rl-zero",
    eagle_depth: int = EAGLE_DEPTH,
    tree_fixed_ms: float = 0.0,
) -> dict:
    """Per drafter name: generation and step speed-up over plain decoding in preset
    `base`, the seconds behind them and the share of iterations at each size chosen."""
    sim = preset(base)
    lengths = sim.workload.draw()
    learn = sim.learner_stages(sim.tokens(lengths))
    ar = sim.stages(sim.generation(Speculation(), lengths)["gen_s"], learn)
    out = {}
    for name, acc in acceptance.items():
        spec = drafter_spec(name, acc, tree_overhead, draft_ms, eagle_depth, tree_fixed_ms)
        gen = sim.generation(spec, lengths)
        st = sim.stages(gen["gen_s"], learn)
        iters = sum(gen["depth_hist"])
        out[name] = {
            "gen_speedup": ar["gen"] / st["gen"],
            "step_speedup": ar["step"] / st["step"],
            "gen_s": st["gen"],
            "step_s": st["step"],
            "gen_ar_s": ar["gen"],
            "step_ar_s": ar["step"],
            "sizes": {n: round(c / iters, 4) for n, c in enumerate(gen["depth_hist"]) if c},
        }
    return out


def gpu_costs(report: dict, shape: str, graphs: bool = True) -> dict[str, float]:
    """The tree inputs of a projection from `benchmarks/gpu_check.py`'s report: its rows
    of `shape` (with or without graphs) give, per batch measured, the tree path's fixed
    time as what a tree of 4 nodes costs over a random chain of 4 tokens (the same width:
    what is left is the mask, the walk and the path's compaction) and the tree overhead
    as a tree of 16 nodes, less that fixed time, over a chain of 16; medians over the
    batches. Returns {"tree_fixed_ms", "tree_overhead", "batches"}."""
    ms: dict[tuple[str, int], float] = {}
    for r in report.get("rows", []):
        if r.get("shape") == shape and bool(r.get("graphs")) == graphs and r.get("ms_per_iter"):
            ms[r["mode"], int(r["batch"])] = float(r["ms_per_iter"])
    need = ("tree4", "rchain4", "tree16", "rchain16")
    batches = sorted({b for _, b in ms if all((m, b) in ms for m in need)})
    if not batches:
        raise ValueError(
            f"the gpu_check report has no rows of {', '.join(need)} for shape {shape!r} "
            f"(graphs={graphs}) at one batch; shapes: "
            f"{sorted({r.get('shape') for r in report.get('rows', [])})}"
        )
    fixed = [max(ms["tree4", b] - ms["rchain4", b], 0.0) for b in batches]
    over = [(ms["tree16", b] - f) / ms["rchain16", b] for b, f in zip(batches, fixed, strict=True)]
    return {
        "tree_fixed_ms": statistics.median(fixed),
        "tree_overhead": max(statistics.median(over), 1e-3),
        "batches": batches,
    }
