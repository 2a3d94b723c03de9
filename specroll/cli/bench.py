"""`specroll bench engine | spec | profile | backends`: measure the engine on this machine."""

from __future__ import annotations

import argparse
import json

from rich.table import Table

from specroll.cli import common
from specroll.cli.bounds import MAX_BATCH, check_temperature, int_list
from specroll.outputs import check_file
from specroll.progress import status

MAX_NODES = 256
"""Most draft tokens (chains) or nodes (trees) per row a --k or --q flag takes, as
`rollout.k` takes for a tree drafter."""
MAX_CTX = 1 << 20
"""Longest context a profile measures (--ctx), beyond any supported model's window."""


GRAPHS_HELP = "on CUDA, replay the engine's decoding step as CUDA graphs (engine.graphs)"


def add_placement_args(p: argparse.ArgumentParser) -> None:
    """--device and --dtype of commands that run the engine."""
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="weights and KV cache (logits, sampling and verification are fp32 either way)",
    )


def load_placed_policy(args: argparse.Namespace):
    """(Transformer, Tokenizer) of --model on --device in --dtype (names checked first,
    so a bad flag fails before the model loads)."""
    from specroll.device import resolve_device, resolve_dtype
    from specroll.model.weights import for_inference

    device = resolve_device(args.device, "--device")
    dtype = resolve_dtype(args.dtype, "--dtype")
    model, tok = common.load_policy(args.model)
    return for_inference(model, device, dtype), tok


def check_counts(args: argparse.Namespace) -> None:
    """--repeats and --new-tokens of a benchmark are at least 1 (a median of no runs has
    no value), checked before the model loads."""
    for flag in ("repeats", "new_tokens"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    for flag in ("group", "past"):
        value = getattr(args, flag, None)
        if value is not None and value < 0:
            raise ValueError(f"--{flag} must be >= 0, got {value}")


def cmd_bench_engine(args: argparse.Namespace) -> None:
    from specroll.engine.bench import bench_engine

    check_counts(args)
    batches = list(int_list("--batches", args.batches, 1, MAX_BATCH))
    verify = list(int_list("--verify-batches", args.verify_batches, 1, MAX_BATCH))
    model, tok = load_placed_policy(args)
    report = bench_engine(
        model,
        tok,
        model_name=args.model,
        batches=batches,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        hf=not args.no_hf,
        verify_batches=verify,
        log=common.console.print,
        cuda_graphs=args.cuda_graphs,
    )
    table = Table(title="engine throughput (tok/s, median)")
    for col in ("batch", "specroll", "transformers", "ratio"):
        table.add_column(col, justify="right")
    for row in report["rows"]:
        table.add_row(
            str(row["batch"]),
            f"{row['specroll_tok_s']:.1f}",
            f"{row.get('hf_tok_s') or 0:.1f}",
            f"{row.get('ratio') or 0:.2f}",
        )
    common.console.print(table)
    where = report["config"]
    common.console.print(f"device {where['device']}, dtype {where['dtype']}")
    vt = Table(title="verification cost: time(q tokens/row) / time(1 token/row)")
    qs = sorted({v["q"] for v in report["verify_cost"]})
    vt.add_column("batch", justify="right")
    for q in qs:
        vt.add_column(f"q={q}", justify="right")
    for b in sorted({v["batch"] for v in report["verify_cost"]}):
        cells = {v["q"]: v["ratio"] for v in report["verify_cost"] if v["batch"] == b}
        vt.add_row(str(b), *(f"{cells[q]:.2f}" for q in qs))
    common.console.print(vt)
    if args.json:
        print(json.dumps(report))


def cmd_bench_spec(args: argparse.Namespace) -> None:
    from specroll.drafting import registry
    from specroll.engine.bench import bench_spec

    check_counts(args)
    batches = list(int_list("--batches", args.batches, 1, MAX_BATCH))
    ks = list(int_list("--k", args.k, 0, MAX_NODES))
    check_temperature("--temperature", args.temperature)
    model, tok = load_placed_policy(args)
    report = bench_spec(
        model,
        tok,
        drafters=args.drafters.split(","),
        batches=batches,
        ks=ks,
        build=registry.build,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        temperature=args.temperature,
        log=common.log,
        group=args.group,
        past=args.past,
        cuda_graphs=args.cuda_graphs,
    )
    where = report["config"]
    title = f"speculative decoding (T={args.temperature}, {where['device']}, {where['dtype']})"
    common.spec_table(report, title)
    if args.json:
        print(json.dumps(report))


def cmd_bench_profile(args: argparse.Namespace) -> None:
    from specroll.drafting import registry
    from specroll.engine.profile import PROFILE_PROMPTS_SEED, profile
    from specroll.tasks.sets import encode, prompt_set

    check_counts(args)
    out = check_file(args.out, "--out")  # now, not after the profiling
    batches = int_list("--batches", args.batches, 1, MAX_BATCH)
    qs = int_list("--q", args.q, 1, MAX_NODES + 1)
    ctxs = int_list("--ctx", args.ctx, 1, MAX_CTX)
    model, tok = common.load_policy(args.model)
    drafter = registry.build(args.drafter, model) if args.drafter else None
    prompts = [encode(tok, p) for p in prompt_set("math", 8, seed=PROFILE_PROMPTS_SEED)]
    with status(common.console, "profiling (target forward grid, then engine runs)"):
        cm = profile(
            model,
            drafter,
            prompts,
            batches=batches,
            qs=qs,
            ctxs=ctxs,
            repeats=args.repeats,
            log=common.log,
        )
    cm.meta.update(model=args.model, drafter_spec=args.drafter)
    out.parent.mkdir(parents=True, exist_ok=True)
    cm.save(out)
    err = cm.meta["fit_error"]
    common.console.print(
        f"fit: fixed {cm.fixed * 1e3:.2f} ms, {cm.per_token * 1e3:.3f} ms/token above "
        f"{cm.knee:.0f} tokens, kv {cm.kv * 1e9:.2f} ns/token/ctx; draft per token "
        f"{cm.draft_step * 1e3:.2f} + {cm.draft_step_per_row * 1e3:.3f}/row ms; error {err}"
    )
    common.console.print(f"[green]profile[/]: {out}")
    if args.json:
        print(json.dumps({"bench": "profile", "profile": str(out), "fit_error": err}))


def cmd_bench_backends(args: argparse.Namespace) -> None:
    from specroll.model.hub import resolve
    from specroll.rl.rollout.bench import bench_backends, builtin_prompt_ids, check_settings

    batches = list(int_list("--batches", args.batches, 1, MAX_BATCH))
    backends = tuple(args.backends.split(","))
    check_temperature("--temperature", args.temperature)
    check_settings(backends, batches, args.repeats, args.draft)  # before loading anything
    model, tok = load_placed_policy(args)
    report = bench_backends(
        model,
        builtin_prompt_ids(tok),
        policy_dir=resolve(args.model),
        draft_dir=args.draft,
        batches=batches,
        k=args.k,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        temperature=args.temperature,
        backends=backends,
        log=common.log,
    )
    table = Table(title=f"rollout backends (tok/s, median of {args.repeats}, T={args.temperature})")
    for col in ("batch", "backend", "mode", "tok/s", "AL", "spec/AR", "own/vLLM"):
        table.add_column(col, justify="right")
    for r in report["rows"]:
        cells = [r.get("acceptance_length"), r.get("speedup_vs_ar"), r.get("own_over_vllm")]
        table.add_row(
            str(r["batch"]),
            r["backend"],
            r["mode"],
            f"{r['tok_s']:.1f}",
            *("" if c is None else f"{c:.3f}" for c in cells),
        )
    common.console.print(table)
    if args.json:
        print(json.dumps(report))


def add_parser(sub) -> None:
    """bench engine | spec | profile | backends"""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="what")
    bench.required = True
    be = bench.add_parser("engine", help="engine vs transformers throughput, verify cost")
    be.add_argument("--model", default="smollm2")
    be.add_argument("--batches", default="1,8,32")
    be.add_argument("--new-tokens", type=int, default=128)
    be.add_argument("--repeats", type=int, default=3, help="runs per point (median)")
    be.add_argument("--verify-batches", default="1,4,16,64")
    be.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    add_placement_args(be)
    be.add_argument("--json", action="store_true", help="end with one JSON line")
    be.add_argument("--cuda-graphs", action="store_true", help=GRAPHS_HELP)
    be.set_defaults(func=cmd_bench_engine)
    bs = bench.add_parser("spec", help="speculative vs plain decoding, same prompts and seeds")
    bs.add_argument("--model", default="smollm2")
    bs.add_argument(
        "--drafters",
        default="ngram,self",
        help="comma list: ngram, self, history, eagle3:PATH, ...; SPEC@K runs SPEC at its own k",
    )
    bs.add_argument("--batches", default="1,4,16")
    bs.add_argument("--k", default="1,3,5")
    bs.add_argument("--new-tokens", type=int, default=128)
    bs.add_argument("--temperature", type=float, default=1.0)
    bs.add_argument(
        "--group",
        type=int,
        default=0,
        help="GRPO groups of math prompts of this size (0: built-in)",
    )
    bs.add_argument(
        "--past", type=int, default=1, help="earlier epochs a history drafter starts with"
    )
    bs.add_argument("--repeats", type=int, default=3, help="runs per point (median)")
    add_placement_args(bs)
    bs.add_argument("--json", action="store_true", help="end with one JSON line")
    bs.add_argument("--cuda-graphs", action="store_true", help=GRAPHS_HELP)
    bs.set_defaults(func=cmd_bench_spec)
    bb = bench.add_parser("backends", help="specroll's engine vs vLLM, plain and EAGLE-3")
    bb.add_argument("--model", default="smollm2")
    bb.add_argument("--draft", help="EAGLE-3 draft directory (without it: plain decoding only)")
    bb.add_argument("--backends", default="local,vllm", help="comma list: local, vllm")
    bb.add_argument("--batches", default="1,4,16,32")
    bb.add_argument("--k", type=int, default=3, help="draft depth (fixed, every batch size)")
    bb.add_argument("--new-tokens", type=int, default=128)
    bb.add_argument("--temperature", type=float, default=1.0)
    bb.add_argument("--repeats", type=int, default=3, help="rounds (median)")
    add_placement_args(bb)
    bb.add_argument("--json", action="store_true", help="end with one JSON line")
    bb.set_defaults(func=cmd_bench_backends)
    bp = bench.add_parser("profile", help="measure this machine and fit the step-time model")
    bp.add_argument("--model", default="smollm2")
    bp.add_argument("--drafter", help="drafter spec for the draft/overhead terms (eagle3:PATH)")
    bp.add_argument("--out", default="profiles/cpu.json", help="hardware profile to write")
    bp.add_argument("--batches", default="1,2,4,8,16,32")
    bp.add_argument("--q", default="1,2,4,8", help="tokens per row")
    bp.add_argument("--ctx", default="64,256,1024", help="context lengths")
    bp.add_argument("--repeats", type=int, default=5)
    bp.add_argument("--json", action="store_true", help="end with one JSON line")
    bp.set_defaults(func=cmd_bench_profile)
