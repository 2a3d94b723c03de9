"""LoRA against full fine-tuning, and a draft that follows the LoRA policy against one
frozen at the base (issue 48), compared on finished runs of the same preset and seed.

Runs (`NAME=RUN_DIR`), e.g. on the default preset, 30 steps, fixed depth k = 3 (drafting
whenever at most `rollout.spec_max_batch` = 4 rows are active: a batch's tail, 12-28 %
of the decode iterations here) so that the acceptance length is measured at every step,
the log-probs checked against the learner's at every step:
  C="--steps 30 --set pipeline.checkpoint_every=0 --set rollout.depth=fixed \\
     --set rollout.k=3 --set learner.check_every=1 --set draft.init=offline"
  specroll train --out runs/full $C
  specroll train --out runs/lora $C --set lora.rank=32
  specroll train --out runs/lora-frozen $C --set lora.rank=32 --set draft.online=false
  specroll train --out runs/lora-adapters $C --set lora.rank=32 --set lora.serve=adapters
  specroll train --out runs/lora-lr5e-6 $C --set lora.rank=32 --set lora.lr=5e-6
  python benchmarks/lora_runs.py full=runs/full lora=runs/lora \\
      frozen=runs/lora-frozen adapters=runs/lora-adapters lora-lr5e-6=runs/lora-lr5e-6 \\
      --plot lora_runs.png

Per run and step: reward, validation accuracy, the measured acceptance length, the
engine's log-prob mismatch against the learner (`logprob_mismatch_max`), the train
stage's seconds and the bytes each refit carried. Prints one JSON line (per-step lists,
medians, the reward's paired sign-flip p between every two runs: an indication, samples
within a run are clustered); `--plot`: reward and validation curves, and the acceptance
length and the log-prob mismatch per step, in one figure.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_io import Parser, fail, metrics_rows, output, run_config, run_spec  # noqa: E402
from rl_exactness import signflip_p  # noqa: E402

from specroll.rl.run.report import acceptance_length_mean  # noqa: E402


def read_run(spec: str) -> tuple[str, dict]:
    """NAME=DIR -> (name, per-step figures)."""
    name, path, _ = run_spec(spec)
    rows = metrics_rows(path)
    steps = [m for m in rows if "reward" in m]
    if not steps:
        fail(f"{spec!r}: {path / 'metrics.jsonl'} has no training step yet")
    config = run_config(path)
    return name, {
        "lora": config.get("lora", {}),
        "lr": steps[0].get("lr") if steps else None,
        "steps": [m["step"] for m in steps],
        "reward": [m["reward"] for m in steps],
        "val_accuracy": {
            m["step"]: m["val_accuracy"] for m in rows if m.get("val_accuracy") is not None
        },
        "acceptance_length": [m.get("acceptance_length") for m in steps],
        "acceptance_length_mean": acceptance_length_mean(steps),
        "acceptance_length_last10": acceptance_length_mean(steps[-10:]),
        "logprob_mismatch_max": [m.get("logprob_mismatch_max") for m in steps],
        "train_s": [m.get("time", {}).get("train") for m in steps],
        "refit_bytes": steps[-1].get("refit_bytes") if steps else None,
    }


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 6) if xs else None


def main() -> None:
    ap = Parser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="NAME=RUN_DIR")
    ap.add_argument("--plot", type=output, help="write the figure here (PNG)")
    args = ap.parse_args()
    runs = dict(read_run(s) for s in args.runs)
    summary = {
        n: {
            "mean_reward": round(statistics.mean(r["reward"]), 4),
            "final_val_accuracy": r["val_accuracy"].get(max(r["val_accuracy"], default=0)),
            "median_acceptance_length": _median(r["acceptance_length"]),
            "acceptance_length": r["acceptance_length_mean"],
            "acceptance_length_last10": r["acceptance_length_last10"],
            "max_logprob_mismatch": max(
                (x for x in r["logprob_mismatch_max"] if x is not None), default=None
            ),
            "median_train_s": _median(r["train_s"][1:]),
            "refit_bytes": r["refit_bytes"],
        }
        for n, r in runs.items()
    }
    names = list(runs)
    pairs = {
        f"{a}~{b}": round(signflip_p(runs[a]["reward"], runs[b]["reward"]), 4)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if len(runs[a]["reward"]) == len(runs[b]["reward"])
    }
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
        for n, r in runs.items():
            line = ax1.plot(r["steps"], r["reward"], alpha=0.6, label=f"{n} reward")[0]
            val = sorted(r["val_accuracy"].items())
            ax1.plot(*zip(*val, strict=True), "o--", color=line.get_color(), label=f"{n} val")
            al = [(s, a) for s, a in zip(r["steps"], r["acceptance_length"], strict=True) if a]
            if al:
                ax2.plot(*zip(*al, strict=True), label=n)
            lp = [(s, x) for s, x in zip(r["steps"], r["logprob_mismatch_max"], strict=True) if x]
            if lp:
                ax3.plot(*zip(*lp, strict=True), label=n)
        ax1.set_ylabel("reward / validation accuracy")
        ax1.legend(fontsize=8)
        ax2.set_ylabel("acceptance length (measured)")
        ax2.legend()
        ax3.set_yscale("log")
        ax3.set_ylabel("logprob_mismatch_max\n(engine vs learner)")
        ax3.set_xlabel("step")
        ax3.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
    print(json.dumps({"summary": summary, "reward_signflip_p": pairs, "runs": runs}))


if __name__ == "__main__":
    main()
