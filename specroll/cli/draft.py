"""`specroll draft data | train | eval`: build and judge drafts offline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specroll.cli import common
from specroll.cli.bounds import MAX_BATCH, MAX_K, check_seed, check_temperature, int_list
from specroll.outputs import LOCK_FILE, DirLock, check_dir


def data_seed_limit() -> int:
    """The largest `draft data --seed`: rollout i is seeded seed * SEED_STRIDE + i
    (`drafting.data`), which must stay below the engine's SEED_LIMIT (2**62)."""
    from specroll.drafting.data import SEED_STRIDE
    from specroll.spec.rng import SEED_LIMIT

    return SEED_LIMIT // SEED_STRIDE - 1


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
    check_dir(args.out, "--out")  # before the model loads, not after the sampling
    check_seed("--seed", args.seed, data_seed_limit())
    check_temperature("--temperature", args.temperature, greedy=False)
    if args.prompts not in ("math", "chat") and Path(args.prompts).is_dir():
        common.check_prompt_file(args.prompts, "--prompts")
    model, tok = common.load_policy(args.policy)
    ids = prompt_ids(tok, cfg)
    with common.progress_bar() as bar:
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
    common.console.print(
        f"[green]data[/]: {out} ({len(data.sequences)} rollouts, {data.num_tokens()} tokens)"
    )


def cmd_draft_train(args: argparse.Namespace) -> None:
    from specroll.drafting.data import DraftData
    from specroll.drafting.train import DraftTrainConfig

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
    check_seed("--seed", args.seed)
    data = DraftData(args.data)
    out_dir = check_draft_out(args)
    model, _ = common.load_policy(args.policy or data.meta["policy"])
    data.check_policy(model)
    with DirLock(out_dir, "--out"):
        out = _train(args, model, data, cfg, out_dir)
    summary = json.loads((out / "train_summary.json").read_text())
    common.console.print(f"[green]draft[/]: {out}  held-out {summary.get('held_out')}")


def check_draft_out(args: argparse.Namespace) -> Path:
    """`draft train --out`, checked before the model loads: a writable directory, not in
    use, that holds no model or draft unless --overwrite (or --resume, which continues the
    draft this command wrote there) says to replace it."""
    out = check_dir(args.out, "--out")
    if out.is_dir() and (out / LOCK_FILE).exists():
        DirLock(out, "--out").acquire().release()  # in use: fails now, naming the holder
    held = sorted(p.name for p in (out.glob("*.safetensors") if out.is_dir() else ()))
    held += ["config.json"] if (out / "config.json").is_file() else []
    resuming = args.resume and (out / "trainer.pt").is_file()
    if held and not (args.overwrite or resuming):
        raise ValueError(
            f"--out={out} already holds a model or draft ({', '.join(held)}); "
            "pass --overwrite to replace it, --resume to continue its training, "
            "or choose another --out"
        )
    return out


def _train(args: argparse.Namespace, model, data, cfg, out_dir: Path) -> Path:
    """train_draft with a progress bar and the log appended to out_dir/train_log.jsonl."""
    from specroll.drafting.train import train_draft

    log_path = out_dir / "train_log.jsonl"
    with common.progress_bar() as bar, open(log_path, "a") as log_file:
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

        return train_draft(model, data, cfg, out_dir, resume=args.resume, log=log)


def _drafter_spec(spec: str) -> str:
    return spec if ":" in spec or spec in ("ngram", "self") else f"eagle3:{spec}"


def cmd_draft_eval(args: argparse.Namespace) -> None:
    from specroll.drafting import registry
    from specroll.drafting.evaluate import eval_draft

    ks = int_list("--k", args.k, 1, MAX_K)
    batches = int_list("--batches", args.batches, 1, MAX_BATCH)
    check_temperature("--temperature", args.temperature)
    model, tok = common.load_policy(args.policy)
    drafters = {d: registry.build(_drafter_spec(d), model) for d in args.draft.split(",")}
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
        log=common.log,
    )
    common.spec_table(report, f"draft evaluation ({args.prompts}, T={args.temperature}, medians)")
    if args.json:
        print(json.dumps(report))


def add_parser(sub) -> None:
    """draft data | train | eval"""
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
    dt.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the model or draft already in --out (refused without it)",
    )
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
