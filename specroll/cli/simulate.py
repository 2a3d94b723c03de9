"""`specroll simulate`: will speculation pay for this model, cluster and workload?

Starts from a preset (`--preset`, see `specroll.sim.presets`) and overrides any input
from the command line; prints the stage breakdown with and without speculation, the
speed-ups, the Amdahl bound, the best depth per active batch size, a k x acceptance
heat-map, and ends with one JSON line. A measured hardware profile (`specroll bench
profile`) replaces the analytic GPU model with this machine's fitted step times.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specroll.cli.bounds import check_range
from specroll.outputs import check_dir
from specroll.sim.catalogue import hardware_spec, model_spec
from specroll.sim.presets import PRESETS, preset
from specroll.sim.rlstep import Pipeline, RLSim
from specroll.sim.rollout import Speculation

KS = (1, 2, 3, 5, 7)
ALS = (1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="project rollout and RL-step speed-ups (simulator)")
    p.add_argument("--preset", default="paper-8b-rl-zero", help=f"one of {sorted(PRESETS)}")
    g = p.add_argument_group("model and hardware")
    g.add_argument("--model", help="catalogue name or a config.json / model directory")
    g.add_argument("--hardware", help="h100, h200, b200 or gb200")
    g.add_argument("--profile", help="measured hardware profile JSON (this machine)")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, help="GPUs in the job")
    c.add_argument("--gen-gpus", type=int, help="generation-only GPUs (0 = colocated)")
    c.add_argument("--tp", type=int, help="generation tensor parallelism")
    c.add_argument("--ep", type=int, help="generation expert parallelism")
    c.add_argument("--max-seqs", type=int, help="sequences per replica at most")
    w = p.add_argument_group("workload")
    w.add_argument("--prompts", type=int)
    w.add_argument("--samples", type=int, help="samples per prompt")
    w.add_argument("--prompt-len", type=int)
    w.add_argument("--mean-len", type=float, help="mean response length (log-normal)")
    w.add_argument("--sigma", type=float, help="log-normal sigma of response lengths")
    w.add_argument("--max-len", type=int, help="response length cap")
    w.add_argument(
        "--lengths-from", help="a run's metrics.jsonl (its last step), or a JSON list of lengths"
    )
    s = p.add_argument_group("speculation and pipeline")
    s.add_argument("--k", type=int, help="draft depth (the deepest, with --adaptive)")
    s.add_argument(
        "--draft-params",
        type=float,
        help="drafter size in parameters (default: one EAGLE-3/MTP layer; a draft model: its size)",
    )
    s.add_argument("--acceptance-length", type=float, help="AL at k (constant alpha)")
    s.add_argument("--alphas", help="per-position conditional acceptance, comma separated")
    s.add_argument("--adaptive", action="store_true", help="choose k per iteration")
    s.add_argument("--lag", type=int, help="async policy lag (0 = synchronous)")
    p.add_argument("--no-sweep", action="store_true", help="skip the k x acceptance grid")
    p.add_argument("--plots", help="directory for heatmap.png and trace.png")
    p.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    p.set_defaults(func=run)


K_MAX = 32
"""The deepest --k simulated: a draft token at depth 32 is accepted with probability
alpha^32 (< 1e-3 even at alpha = 0.8), and every iteration weighs each depth up to k, so
a deeper k adds run time (minutes at 10^6), not information."""


MAX_ROLLOUTS = 1 << 20
"""Most rollouts one simulated step draws (prompts x samples, times lag + 1 steps when
async; the paper's presets draw 8192): each simulation walks every one, about 2.5 s per
million here, and the k x acceptance sweep runs 36 of them (--no-sweep: 2)."""
MAX_LEN = 1 << 22
"""Longest prompt or response in tokens (--prompt-len, --mean-len, --max-len): beyond
the context window of any model in the catalogue."""
MAX_SIGMA = 4.0
"""Largest log-normal sigma of response lengths (at 4, the 99th percentile is already
10^4 times the median)."""
MAX_GPUS = 1 << 20
"""Most GPUs, parallelism degrees and sequences per replica."""
MAX_LAG = 64
"""Most steps of policy lag simulated (each is another step's rollouts)."""
MAX_DRAFT_PARAMS = 1e13
"""Largest drafter size in parameters."""


def check_args(args: argparse.Namespace) -> None:
    """The flags no config validates, before any work: depth, parallelism and sequence
    limits, sizes, the --plots directory. Each is a finite number in its range (NaN and
    inf are not), so the simulation's arrays and loops stay bounded."""
    if args.k is not None and not 0 <= args.k <= K_MAX:
        why = " (deeper drafts are accepted with probability alpha^k, about 0)"
        raise ValueError(f"--k must be in [0, {K_MAX}], got {args.k}" + why * (args.k > 0))
    for flag, value in (("--max-seqs", args.max_seqs), ("--tp", args.tp), ("--ep", args.ep)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, value, low, high in (
        ("--gpus", args.gpus, 1, MAX_GPUS),
        ("--gen-gpus", args.gen_gpus, 0, MAX_GPUS),
        ("--tp", args.tp, 1, MAX_GPUS),
        ("--ep", args.ep, 1, MAX_GPUS),
        ("--max-seqs", args.max_seqs, 1, MAX_GPUS),
        ("--prompts", args.prompts, 1, MAX_ROLLOUTS),
        ("--samples", args.samples, 1, MAX_ROLLOUTS),
        ("--prompt-len", args.prompt_len, 1, MAX_LEN),
        ("--mean-len", args.mean_len, 1, MAX_LEN),
        ("--max-len", args.max_len, 1, MAX_LEN),
        ("--sigma", args.sigma, 0, MAX_SIGMA),
        ("--lag", args.lag, 0, MAX_LAG),
    ):
        check_range(flag, value, low, high)
    if args.draft_params is not None and not 0 < args.draft_params <= MAX_DRAFT_PARAMS:
        raise ValueError(
            f"--draft-params must be in (0, {MAX_DRAFT_PARAMS:g}], got {args.draft_params}"
        )
    if args.acceptance_length is not None and not args.acceptance_length >= 1:
        raise ValueError(f"--acceptance-length must be >= 1, got {args.acceptance_length}")
    if args.plots:
        check_dir(args.plots, "--plots")


def _alphas(text: str) -> list[float]:
    """--alphas: comma-separated acceptance probabilities in [0, 1]."""
    try:
        alphas = [float(a) for a in text.split(",")]
    except ValueError:
        raise ValueError(f"--alphas: comma-separated numbers in [0, 1], got {text!r}") from None
    if not all(0 <= a <= 1 for a in alphas):
        raise ValueError(f"--alphas must be in [0, 1], got {alphas}")
    return alphas


def build(args: argparse.Namespace) -> RLSim:
    """The preset with the command line's overrides applied (validated by the configs)."""
    check_args(args)
    sim = preset(args.preset)
    if args.model:
        sim.model = model_spec(args.model)
    if args.hardware:
        sim.hw = replace(hardware_spec(args.hardware), **_fit_of(sim.hw))
    if args.profile:  # this machine: one engine, generation from its fitted step times
        # a measured profile (numpy only; the engine package itself loads torch)
        from specroll.engine.costmodel import CostModel

        sim.step = CostModel.load(args.profile)
        sim.cluster = replace(sim.cluster, gpus=1, gen_gpus=0, gen_tp=1, gen_ep=1)
    over = {
        "gpus": args.gpus,
        "gen_gpus": args.gen_gpus,
        "gen_tp": args.tp,
        "gen_ep": args.ep,
        "max_seqs": args.max_seqs,
    }
    sim.cluster = replace(sim.cluster, **{k: v for k, v in over.items() if v is not None})
    wl = {
        "prompts": args.prompts,
        "samples": args.samples,
        "prompt_len": args.prompt_len,
        "mean_len": args.mean_len,
        "sigma": args.sigma,
        "max_len": args.max_len,
    }
    sim.workload = replace(sim.workload, **{k: v for k, v in wl.items() if v is not None})
    if args.lengths_from:
        sim.workload = replace(sim.workload, lengths=_lengths(args.lengths_from))
    if args.lag is not None:
        sim.pipeline = Pipeline(lag=args.lag)
    if args.draft_params is not None:
        sim.draft_size = args.draft_params
    k = args.k if args.k is not None else sim.spec.k
    if args.alphas:
        sim.spec = Speculation.padded(_alphas(args.alphas), k)
    elif args.acceptance_length is not None:
        if not 1 <= args.acceptance_length < k + 1:
            raise ValueError(
                f"--acceptance-length must be in [1, k+1={k + 1}), got {args.acceptance_length}"
            )
        sim.spec = Speculation.from_acceptance_length(args.acceptance_length, k)
    elif k != sim.spec.k:
        sim.spec = Speculation.padded(sim.spec.alphas, k)
    sim.spec = replace(sim.spec, adaptive=args.adaptive or sim.spec.adaptive)
    _check_rollouts(sim)
    return sim


def _check_rollouts(sim: RLSim) -> None:
    """ValueError naming the flags unless the step draws at most MAX_ROLLOUTS rollouts."""
    w, steps = sim.workload, sim.pipeline.lag + 1
    n = len(w.lengths) if w.lengths is not None else w.prompts * w.samples
    if n * steps > MAX_ROLLOUTS:
        what = (
            f"--lengths-from: {n} lengths"
            if w.lengths is not None
            else f"--prompts x --samples = {w.prompts} x {w.samples}"
        )
        lag = f" x (--lag {sim.pipeline.lag} + 1)" if sim.pipeline.lag else ""
        raise ValueError(
            f"{what}{lag} = {n * steps} rollouts: the simulator draws at most {MAX_ROLLOUTS}"
        )


def sweep(sim: RLSim) -> dict:
    """Generation and step speed-ups for fixed k x acceptance length (constant alpha)."""
    lengths = sim.workload.draw()
    learn = sim.learner_stages(sim.tokens(lengths))
    ar = sim.stages(sim.generation(Speculation(), lengths)["gen_s"], learn)
    gen, step = [], []
    for k in KS:
        g_row, s_row = [], []
        for al in ALS:
            if al >= k + 1:  # k drafts cannot accept more than k + 1 tokens
                g_row.append(None)
                s_row.append(None)
                continue
            t = sim.generation(Speculation.from_acceptance_length(al, k), lengths)["gen_s"]
            st = sim.stages(t, learn)
            g_row.append(round(ar["gen"] / t, 3))
            s_row.append(round(ar["step"] / st["step"], 3))
        gen.append(g_row)
        step.append(s_row)
    return {"k": list(KS), "acceptance_length": list(ALS), "gen_speedup": gen, "step_speedup": step}


def best_k_by_batch(sim: RLSim, ctx: float) -> dict:
    """The depth that maximises tokens/s at each active batch size (mid-rollout context)."""
    step, spec = sim.step_model(), sim.spec
    out, B = {}, 1
    top = sim.concurrency()
    while True:
        ks = range(spec.k + 1)
        out[B] = max(ks, key=lambda k: spec.tau(k) / step.iteration(B, k, ctx))
        if B >= top:
            return out
        B = min(B * 2, top)


def run(args: argparse.Namespace) -> None:
    sim = build(args)
    res = sim.run()
    ctx = sim.workload.prompt_len + res["mean_len"] / 2
    out = {
        "preset": args.preset,
        "model": sim.model.name,
        "hardware": "profile:" + args.profile if args.profile else sim.hw.name,
        "cluster": asdict(sim.cluster),
        "workload": {k: v for k, v in asdict(sim.workload).items() if k != "lengths"},
        "k": sim.spec.k,
        "alphas": [round(a, 4) for a in sim.spec.alphas],
        "adaptive": sim.spec.adaptive,
        "lag": sim.pipeline.lag,
        "acceptance_length": round(res["acceptance_length"], 3),
        "gen_speedup": round(res["gen_speedup"], 3),
        "step_speedup": round(res["step_speedup"], 3),
        "amdahl_bound": None if res["amdahl_bound"] is None else round(res["amdahl_bound"], 3),
        "stages_ar": {k: round(v, 3) for k, v in res["stages_ar"].items()},
        "stages_spec": {k: round(v, 3) for k, v in res["stages_spec"].items()},
        "concurrency": res["concurrency"],
        "best_k_by_batch": best_k_by_batch(sim, ctx),
    }
    if not args.no_sweep:
        out["sweep"] = sweep(sim)
    if args.plots:
        from specroll.cli.sim_plots import heatmap, trace

        d = check_dir(args.plots, "--plots")
        d.mkdir(parents=True, exist_ok=True)
        name = f"{args.preset}: {sim.model.name} on {out['hardware']}"
        if "sweep" in out:
            heatmap(out["sweep"], d / "heatmap.png", name)
        trace(res["trace_ar"], res["trace_spec"], d / "trace.png", name)
        out["plots"] = str(d)
    if not args.json:
        con = Console()
        t = Table(title=f"{args.preset} ({out['model']}, {out['hardware']})")
        t.add_column("stage")
        t.add_column("AR s", justify="right")
        t.add_column("speculative s", justify="right")
        for stage in out["stages_ar"]:
            t.add_row(stage, f"{out['stages_ar'][stage]:.2f}", f"{out['stages_spec'][stage]:.2f}")
        con.print(t)
        bound = out["amdahl_bound"]
        con.print(
            f"generation x{out['gen_speedup']:.2f}, step x{out['step_speedup']:.2f}"
            + (f", Amdahl bound x{bound:.2f}" if bound else "")
            + f"; best k by active batch: {out['best_k_by_batch']}"
        )
    print(json.dumps(out))


def _fit_of(hw) -> dict:
    """Efficiency factors of the current hardware (kept when only the GPU changes)."""
    keys = ("flop_eff", "mem_eff", "step_overhead", "draft_overhead")
    return {k: getattr(hw, k) for k in keys}


def _lengths(path: str) -> list[int]:
    """Response lengths: a JSON list, a run's metrics.jsonl (the last step's
    `response_lengths`), or a JSONL of rollouts with `length` or `token_ids`."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--lengths-from {path}: no such file")
    text = p.read_text().strip()
    if text.startswith("["):
        return [int(x) for x in json.loads(text)]
    out: list[int] = []
    for line in text.splitlines():
        rec = json.loads(line)
        if "response_lengths" in rec:
            out = [int(x) for x in rec["response_lengths"]]  # a later step replaces it
        elif "step" in rec:
            continue  # metrics lines without lengths (validation, older runs)
        elif "length" in rec:
            out.append(int(rec["length"]))
        elif "token_ids" in rec:
            out.append(len(rec["token_ids"]))
        else:
            raise ValueError(f"{path}: a record has neither 'length' nor 'token_ids'")
    if not out:
        raise ValueError(f"{path}: no lengths")
    return out
