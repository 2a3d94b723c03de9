"""The end-of-run report: `report.md` and PNG plots beside `metrics.jsonl`.

What a user reads after `specroll train`: did the policy learn (reward, training and
validation accuracy per step), how well did the draft keep up (acceptance length per
step), where did the time go (stage breakdown), and what did speculation buy — the
generation speed-up measured against plain decoding of the same requests with the same
weights (shadow rollouts), the resulting step speed-up, and the Amdahl bound
1 / (R_gen / S_gen + 1 - R_gen) that a perfect overlap of everything else would give.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from specroll.rl.config import TrainConfig

STAGES = ("gen", "reward", "logprob", "train", "prepare")


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
    als = [r["acceptance_length"] for r in steps if r.get("acceptance_length")]
    out["acceptance_length_mean"] = round(statistics.mean(als), 4) if als else None
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
        out["amdahl_bound"] = round(1 / (r_gen / s_gen + 1 - r_gen), 4)
        al = out["acceptance_length_mean"]
        if al:
            out["amdahl_bound_at_al"] = round(1 / (r_gen / al + 1 - r_gen), 4)
    return out


def write_report(out: Path, rows: list[dict], cfg: TrainConfig) -> Path:
    """Write report.md and plots into `out`; returns the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if "time" in r]
    summary = summarise(rows)
    x = [r["step"] for r in steps]
    figs = {}
    if steps:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(x, [r["reward"] for r in steps], "o-", label="train reward")
        v = [(r["step"], r["val_accuracy"]) for r in rows if "val_accuracy" in r]
        if v:
            ax.plot(*zip(*v, strict=True), "s--", label="validation accuracy")
        ax.set_xlabel("step")
        ax.legend()
        ax.set_title("reward and accuracy")
        figs["reward.png"] = fig
        fig, ax = plt.subplots(figsize=(6, 3.5))
        al = [(r["step"], r["acceptance_length"]) for r in steps if r.get("acceptance_length")]
        if al:
            ax.plot(*zip(*al, strict=True), "o-")
        ax.set_xlabel("step")
        ax.set_ylabel("acceptance length")
        ax.set_title(f"draft acceptance (k = {cfg.rollout.k})")
        figs["acceptance.png"] = fig
        fig, ax = plt.subplots(figsize=(6, 3.5))
        bottom = [0.0] * len(steps)
        for st in STAGES:
            h = [r["time"].get(st, 0.0) for r in steps]
            ax.bar(x, h, bottom=bottom, label=st)
            bottom = [b + y for b, y in zip(bottom, h, strict=True)]
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.legend()
        ax.set_title("stage times")
        figs["stages.png"] = fig
    for name, fig in figs.items():
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
    lines = [
        f"# specroll run: {out}",
        "",
        f"Policy `{cfg.policy.model}`, task `{cfg.data.task}`, {summary['steps']} steps of "
        f"{cfg.data.prompts_per_step} prompts x {cfg.data.group_size} samples, "
        f"speculative={cfg.rollout.speculative} (k = {cfg.rollout.k}, depth "
        f"{cfg.rollout.depth}); "
        + (
            f"rollouts on {cfg.ray.workers} Ray workers"
            if cfg.ray.enabled
            else "rollouts in-process"
        )
        + (f", async with max_lag {cfg.pipeline.max_lag}." if cfg.pipeline.max_lag else ", sync."),
        "",
        "| figure | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in summary.items()]
    lines += [
        "",
        "How to read it: `gen_speedup` is plain-decoding time over speculative time for the",
        "same requests and weights (shadow rollouts every `pipeline.shadow_every` steps);",
        "`amdahl_bound` is 1 / (R_gen / S_gen + 1 - R_gen) with R_gen the generation share",
        "of the plain-decoding step: the step speed-up if nothing else changes;",
        "`amdahl_bound_at_al` is the same with the acceptance length as S_gen (free drafts",
        "and verification). `exposed_gen_mean_s` is what the learner waited for rollouts",
        "(all of generation when synchronous, only what training did not hide when async);",
        "`gen_busy_mean_s` is generation's own wall time; `lag_histogram` counts samples by",
        "how many updates old their policy was.",
        "",
    ]
    lines += [f"![{n}]({n})" for n in figs]
    lines += ["", "| step | reward | val acc | AL | gen s | logprob s | train s | step s |"]
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
