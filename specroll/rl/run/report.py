"""The end-of-run report: `report.md` and PNG plots beside `metrics.jsonl`.

What a user reads after `specroll train`: did the policy learn (reward, training
accuracy and validation reward per step), how well did the draft keep up (acceptance length per
step), where did the time go (stage breakdown), and what did speculation buy — the
generation speed-up measured against plain decoding of the same requests with the same
weights (shadow rollouts), the resulting step speed-up, and the Amdahl bound
1 / (R_gen / S_gen + 1 - R_gen) that a perfect overlap of everything else would give.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specroll.engine.request import Results
from specroll.rl.config import TrainConfig
from specroll.rl.run.gpu_estimate import simulated, with_simulated
from specroll.sim.run_on_gpu import GpuEstimate

if TYPE_CHECKING:
    from specroll.rl.run.refill import StepGroups

STAGES = ("gen", "reward", "logprob", "train", "prepare")


def step_metrics(
    step: int,
    times: dict[str, float],
    results: Results,
    rewards: torch.Tensor,
    keep: torch.Tensor,
    lag: dict[int, int],
    train_metrics: dict,
    dropped: int = 0,
    restarts: int = 0,
    refill: StepGroups | None = None,
) -> dict:
    """A step's line of metrics.jsonl: the learner's figures (`train_metrics`), then the
    stage times, generation, rewards and speculation (a probed step's shadow figures are
    `shadow.ShadowProbe.metrics`).

    rewards: [P, G]; keep: [P] the groups trained on; lag: {versions old: samples};
    refill: the step's groups with dynamic-sampling refill (`run.refill`), whose rounds,
    groups and tokens are counted (already part of results, rewards and keep)."""
    spec = results.stats
    lengths = torch.tensor([len(r.token_ids) for r in results], device="cpu")
    n_tok = int(lengths.sum())
    m = dict(train_metrics)
    m.update(
        step=step,
        time={k: round(v, 3) for k, v in times.items()},
        step_s=round(sum(times.values()), 3),
        gen_tokens=n_tok,
        gen_tok_s=round(n_tok / max(spec.total_s, 1e-9), 2),
        gen_busy_s=round(spec.total_s, 3),  # generation wall time (slowest worker)
        exposed_gen_s=round(times["gen"], 3),  # what the learner waited for
        lag={str(k): v for k, v in sorted(lag.items())},
        dropped_samples=dropped,
        worker_restarts=restarts,
        reward=round(float(rewards.mean()), 4),
        accuracy=round(float((rewards > 0).float().mean()), 4),
        response_len_mean=round(float(lengths.float().mean()), 2),
        response_len_max=int(lengths.max()),
        response_lengths=lengths.tolist(),  # `specroll simulate --lengths-from`
        groups_kept=int(keep.sum()),
        groups=rewards.shape[0],
        acceptance_length=round(spec.acceptance_length, 4) if spec.drafts else None,
        tokens_per_target_forward=round(spec.tokens_per_target_forward, 4),
        tau_at=tau_table(spec),
        per_position=[round(x, 4) for x in spec.per_position] if spec.drafts else None,
        depth_hist=list(spec.depth_hist),  # decode iterations by draft depth (0 = plain)
        policy_version=step,
    )
    if refill is not None:
        m["refill_rounds"] = refill.rounds
        m["refill_groups"] = refill.refill_groups
        m["refill_tokens"] = refill.refill_tokens
    return m


def _depth_name(cfg: TrainConfig) -> str:
    """'nodes' for a tree drafter's budget, 'k' for a chain's depth."""
    return "nodes" if cfg.rollout.tree else "k"


def tau_table(spec) -> dict[str, float] | None:
    """Tokens per row-iteration each draft size 1, 2, 4, ... would have emitted
    (`SpecStats.tau_at`), up to the largest verified; None without drafts."""
    k = len(spec.node_rows) or len(spec.per_position)
    if not k or not spec.drafts:
        return None
    sizes = sorted({1 << i for i in range(k.bit_length())} | {k})
    return {str(m): round(spec.tau_at(m), 4) for m in sizes if m <= k}


def deepest(depth_hist: list[int] | None) -> int:
    """The deepest draft (tokens per row) any iteration used, from a depth histogram."""
    return max((k for k, n in enumerate(depth_hist or []) if n), default=0)


def speculated(depth_hist: list[int] | None) -> tuple[int, int]:
    """(decode iterations that drafted, all decode iterations) from a depth histogram."""
    hist = depth_hist or []
    return sum(hist[1:]), sum(hist)


def step_line(m: dict, steps: int) -> str:
    """One readable line per RL step for the console and logs (the full figures are in
    metrics.jsonl): 'step 3/10  reward 0.312  acc 0.281  val reward 0.300  len 54  AL 1.32
    gen 12.1s (x1.02)  logprob 3.2s  train 20.1s  step 36.0s  211 tok/s'."""
    t = m["time"]
    parts = [f"step {m['step']}/{steps}", f"reward {m['reward']:.3f}", f"acc {m['accuracy']:.3f}"]
    if "val_accuracy" in m:
        parts.append(f"val reward {m['val_accuracy']:.3f}")
    parts.append(f"len {m['response_len_mean']:.0f}")
    if m.get("acceptance_length"):  # with how much speculation earned it
        drafted, iters = speculated(m.get("depth_hist"))
        parts.append(f"AL {m['acceptance_length']:.2f} in {drafted}/{iters} iters")
    gen = f"gen {t['gen']:.1f}s"
    if "gen_speedup" in m:
        gen += f" (x{m['gen_speedup']:.2f} vs plain"
        if "gen_rate_speedup" in m:
            gen += f", tok/s x{m['gen_rate_speedup']:.2f}"
        gen += ")"
    parts += [gen, f"logprob {t['logprob']:.1f}s", f"train {t['train']:.1f}s"]
    parts += [f"step {m['step_s']:.1f}s", f"{m['gen_tok_s']:.0f} tok/s"]
    return "  ".join(parts)


def acceptance_length_mean(steps: list[dict]) -> float | None:
    """AL per drafting iteration over steps' metrics: each step's AL weighted by how many
    of its decode iterations drafted (None when none did)."""
    weighted = [
        (r["acceptance_length"], speculated(r.get("depth_hist"))[0])
        for r in steps
        if r.get("acceptance_length")
    ]
    n = sum(w for _, w in weighted)
    return round(sum(a * w for a, w in weighted) / n, 4) if n else None


def summarise(rows: list[dict]) -> dict:
    """Headline figures of a run from its metrics lines."""
    steps = [r for r in rows if "time" in r]
    vals = [(r["step"], r["val_accuracy"]) for r in rows if "val_accuracy" in r]
    out: dict = {"steps": len(steps)}
    if vals:
        out["val_accuracy_start"], out["val_accuracy_end"] = vals[0][1], vals[-1][1]
    if not steps:
        return out
    stage = {k: statistics.mean(r["time"].get(k, 0.0) for r in steps) for k in STAGES}
    total = sum(stage.values())
    out["stage_mean_s"] = {k: round(v, 3) for k, v in stage.items()}
    out["step_mean_s"] = round(total, 3)
    out["gen_share"] = round(stage["gen"] / total, 4) if total else None
    out["deepest_draft"] = max((deepest(r.get("depth_hist")) for r in steps), default=0)
    out["acceptance_length_mean"] = acceptance_length_mean(steps)
    counts = [speculated(r.get("depth_hist")) for r in steps]
    drafted, iters = sum(d for d, _ in counts), sum(i for _, i in counts)
    out["speculated_share"] = round(drafted / iters, 4) if iters else None
    out["reward_first"], out["reward_last"] = steps[0]["reward"], steps[-1]["reward"]
    busy = [r["gen_busy_s"] for r in steps if "gen_busy_s" in r]
    if busy:  # generation's own wall time vs what the learner waited for (async)
        out["gen_busy_mean_s"] = round(statistics.mean(busy), 3)
        out["exposed_gen_mean_s"] = round(statistics.mean(r["exposed_gen_s"] for r in steps), 3)
        lag: dict[str, int] = {}
        for r in steps:
            for k, v in r.get("lag", {}).items():
                lag[k] = lag.get(k, 0) + v
        out["lag_histogram"] = dict(sorted(lag.items()))
        out["dropped_samples"] = steps[-1].get("dropped_samples", 0)
        out["worker_restarts"] = steps[-1].get("worker_restarts", 0)
    sh = [r for r in steps if "gen_speedup" in r]
    if sh:
        s_gen = statistics.median(r["gen_speedup"] for r in sh)
        r_gen = stage["gen"] * s_gen / (total - stage["gen"] + stage["gen"] * s_gen)
        out["gen_speedup"] = round(s_gen, 4)
        rates = [r["gen_rate_speedup"] for r in sh if "gen_rate_speedup" in r]
        if rates:
            out["gen_rate_speedup"] = round(statistics.median(rates), 4)
        # the same step with the shadow's plain generation in place of the speculative one
        plain = [(r["step_s"] - r["time"]["gen"] + r["shadow_ar_gen_s"]) / r["step_s"] for r in sh]
        out["step_speedup"] = round(statistics.median(plain), 4)
        out["amdahl_bound"] = round(1 / (r_gen / s_gen + 1 - r_gen), 4)
        al = out["acceptance_length_mean"]
        if al:
            out["amdahl_bound_at_al"] = round(1 / (r_gen / al + 1 - r_gen), 4)
    return out


def _share(r: dict) -> float | None:
    drafted, iters = speculated(r.get("depth_hist"))
    return drafted / iters if iters else None


EXPLAIN = {
    "val_accuracy_start": "`val_accuracy_start` / `val_accuracy_end`: the mean reward of "
    "one sample per validation prompt (fixed seeds) at the first and the last validation "
    "(an accuracy when the rewards are 0 or 1).",
    "stage_mean_s": "`stage_mean_s`: mean seconds per step in each stage.",
    "gen_share": "`gen_share`: generation's share of the mean step.",
    "acceptance_length_mean": "`acceptance_length_mean`: tokens emitted per drafting row "
    "and iteration, over the iterations that drafted (1 = speculation gained nothing).",
    "speculated_share": "`speculated_share`: the share of decode iterations that drafted at "
    "all (the rest decoded plain); the acceptance length applies to these only.",
    "deepest_draft": "`deepest_draft`: the most draft tokens per row any iteration used "
    "(adaptive depth picks 0 where verification costs more than it saves).",
    "gen_busy_mean_s": "`gen_busy_mean_s`: generation's own wall time; "
    "`exposed_gen_mean_s`: what the learner waited for rollouts (all of generation when "
    "synchronous, only what training did not hide when async).",
    "lag_histogram": "`lag_histogram`: samples by how many policy updates old they were.",
    "gen_speedup": "`gen_speedup`: plain-decoding time over speculative time for the same "
    "requests and weights (shadow rollouts every `pipeline.shadow_every` steps), median.",
    "gen_rate_speedup": "`gen_rate_speedup`: speculative tokens/s over plain tokens/s in "
    "the same shadow steps, median. Both draw the same distribution but not the same "
    "samples, so their lengths differ and `gen_speedup` moves with them; the token-rate "
    "ratio measures the decoding itself.",
    "step_speedup": "`step_speedup`: the whole step with plain generation over the step "
    "as run (the shadow steps' stage times), median: what speculation bought end to end.",
    "simulated_gen_speedup": "`simulated_gen_speedup`: simulated, not measured: plain over "
    "speculative generation time of the last step's responses at the run's batch size on "
    "one GPU (`specroll simulate`'s model; prompts of 256 tokens, the draft costed as one "
    "EAGLE-3 layer, adaptive depth), fed this run's acceptance; `simulated_gen_basis` "
    "says the GPU, the depth chosen and where the acceptance comes from.",
    "amdahl_bound": "`amdahl_bound`: 1 / (R_gen / S_gen + 1 - R_gen) with R_gen the "
    "generation share of the plain-decoding step; `amdahl_bound_at_al`: the same with the "
    "acceptance length as S_gen (free drafts and verification).",
}
"""What each summary figure means; only the figures a run has are explained."""


def _cell(v) -> str:
    """A summary value as table text (dicts as 'key value' pairs, not Python reprs)."""
    if isinstance(v, dict):
        return ", ".join(f"{k} {_cell(x)}" for k, x in v.items()) or "-"
    return "-" if v is None else str(v)


def figures(rows: list[dict], summary: dict, cfg: TrainConfig) -> dict:
    """{file name: matplotlib Figure} of the run's plots (empty without steps)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r for r in rows if "time" in r]
    x = [r["step"] for r in steps]
    figs: dict = {}
    if steps:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(x, [r["reward"] for r in steps], "o-", label="train reward")
        v = [(r["step"], r["val_accuracy"]) for r in rows if "val_accuracy" in r]
        if v:
            ax.plot(*zip(*v, strict=True), "s--", label="validation reward (mean)")
        ax.set_ylabel("mean reward")
        ax.legend()
        ax.set_title("reward")
        figs["reward.png"] = fig
        fig, ax = plt.subplots(figsize=(6, 3.5))
        al = [(r["step"], r["acceptance_length"]) for r in steps if r.get("acceptance_length")]
        if al:
            ax.plot(*zip(*al, strict=True), "o-", label="acceptance length")
        ax.axhline(1.0, color="grey", linestyle=":", label="AL = 1 (speculation gains nothing)")
        top = max([a for _, a in al] + [1.0])
        ax.set_ylim(0.9, max(2.0, top * 1.1))  # from 1 up: how far above no-gain it is
        ax.set_ylabel("acceptance length (tokens per draft)")
        ax.legend(loc="upper left")
        share = [(r["step"], _share(r)) for r in steps if _share(r) is not None]
        if share:  # how much speculation earned that acceptance
            ax2 = ax.twinx()
            ax2.bar(*zip(*share, strict=True), alpha=0.2, color="grey", width=0.6)
            ax2.set_ylim(0, 1)
            ax2.set_ylabel("share of iterations that drafted (bars)")
        if cfg.rollout.depth == "adaptive":
            title = (
                f"draft acceptance (adaptive depth, {_depth_name(cfg)} <= {cfg.rollout.k_max}; "
                f"deepest used {summary.get('deepest_draft', 0)})"
            )
        else:
            title = (
                f"draft acceptance ({_depth_name(cfg)} = {cfg.rollout.k_max} up to batch "
                f"{cfg.rollout.spec_max_batch})"
            )
        ax.set_title(title)
        figs["acceptance.png"] = fig
        fig, ax = plt.subplots(figsize=(6, 3.5))
        bottom = [0.0] * len(steps)
        for st in STAGES:
            h = [r["time"].get(st, 0.0) for r in steps]
            ax.bar(x, h, bottom=bottom, label=st)
            bottom = [b + y for b, y in zip(bottom, h, strict=True)]
        ax.set_ylabel("seconds")
        ax.legend()
        ax.set_title("stage times per step")
        figs["stages.png"] = fig
        for fig in figs.values():
            ax = fig.axes[0]
            ax.set_xlabel("RL step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return figs


def write_report(out: Path, rows: list[dict], cfg: TrainConfig) -> Path:
    """Write report.md and plots into `out`; returns the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if "time" in r]
    summary = summarise(rows)
    est = simulated(out, rows, cfg)
    if isinstance(est, GpuEstimate):
        summary = with_simulated(summary, est)
    figs = figures(rows, summary, cfg)
    for name, fig in figs.items():
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
    lines = [
        f"# specroll run: {out}",
        "",
        f"Policy `{cfg.policy.model}`, task `{cfg.data.train or 'math'}` "
        f"(rewards: {', '.join(cfg.reward.functions)}), {summary['steps']} steps of "
        f"{cfg.data.prompts_per_step} prompts x {cfg.data.group_size} samples, "
        f"speculative={cfg.rollout.speculative} (drafter {cfg.rollout.drafter}, "
        f"{'nodes' if cfg.rollout.tree else 'k'} = {cfg.rollout.k_max}, depth "
        f"{cfg.rollout.depth}); "
        + (
            f"rollouts on {cfg.ray.workers} Ray workers"
            if cfg.rollout.backend == "ray"
            else "rollouts in-process"
        )
        + (f", async with max_lag {cfg.pipeline.max_lag}." if cfg.pipeline.max_lag else ", sync."),
        "",
        "| figure | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {_cell(v)} |" for k, v in summary.items()]
    lines += ["", "How to read it:", ""]
    lines += [f"- {text}" for key, text in EXPLAIN.items() if key in summary]
    if "gen_speedup" not in summary:
        lines.append(
            "- No generation speed-up was measured: set `pipeline.shadow_every` (synchronous "
            "runs with a draft) to decode some steps' requests without speculation too."
        )
    if est is not None:  # the measured figures above, then what a GPU would make of them
        lines.append(f"- {est.line() if isinstance(est, GpuEstimate) else est}.")
    lines.append("")
    lines += [f"![{n}]({n})" for n in figs]
    lines += ["", "| step | reward | val reward | AL | gen s | logprob s | train s | step s |"]
    lines += ["|---|---|---|---|---|---|---|---|"]
    for r in steps:
        t = r["time"]
        lines.append(
            f"| {r['step']} | {r['reward']} | {r.get('val_accuracy', '')} | "
            f"{r.get('acceptance_length') or '-'} | {t['gen']} | {t['logprob']} | "
            f"{t['train']} | {r['step_s']} |"
        )
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
