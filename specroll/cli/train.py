"""`specroll train`: GRPO/DAPO training with speculative rollouts."""

from __future__ import annotations

import argparse

from rich.table import Table

from specroll.cli import common


def cmd_train(args: argparse.Namespace) -> None:
    from specroll.rl.config import build_config
    from specroll.rl.draft import build_draft
    from specroll.rl.pipeline import Trainer

    overrides = list(args.set or [])
    if args.out:
        overrides.append(f"pipeline.out_dir={args.out}")
    if args.steps is not None:
        overrides.append(f"pipeline.steps={args.steps}")
    for side in ("rollout", "learner"):  # --device/--dtype: both sides, before any --set
        if args.device:
            overrides.insert(0, f"{side}.device={args.device}")
        if args.dtype:
            overrides.insert(0, f"{side}.dtype={args.dtype}")
    cfg = build_config(args.preset, overrides)
    from specroll.rl import rundir
    from specroll.rl.workload import task_items

    # a bad dataset, a foreign or mismatched checkpoint, or an occupied output directory
    # fail before any model is loaded or any file is written
    task_items(cfg)
    if cfg.rollout.backend == "local":  # (Ray workers and actors resolve theirs where they run)
        from specroll.device import resolve_device

        resolve_device(cfg.rollout.device, "rollout.device")
        resolve_device(cfg.learner.device, "learner.device")
    plan = rundir.check(
        cfg.pipeline.out_dir, cfg.to_dict(), cfg.pipeline.steps, args.resume, args.overwrite
    )
    if plan.action == "finished":
        common.console.print(
            plan.finished_message(cfg.pipeline.out_dir, cfg.pipeline.steps),
            markup=False,
            highlight=False,
        )
        return
    path = common.resolve_model_dir(cfg.policy.model)
    policy, tok = common.load_dir(path)
    with common.progress_bar() as bar:
        tasks: dict[str, int] = {}
        name = {"eagle3": "EAGLE-3", "mtp": "MTP"}[cfg.draft.kind]
        labels = {"data": "draft: sampling the policy", "train": f"draft: training {name}"}

        def on_draft(stage: str, done: int, total: int | None, info: str = "") -> None:
            label = labels.get(stage, stage)
            if stage not in tasks:
                tasks[stage] = bar.add_task(label, total=total)
            desc = f"{label} ({info})" if info else label
            bar.update(tasks[stage], completed=done, total=total, description=desc)

        draft = build_draft(cfg, policy, tok, path, progress=on_draft)
    trainer = Trainer(cfg, policy, tok, draft, log=common.console.print)
    common.console.print(
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

    with common.progress_bar() as bar:
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
            common.console.print(
                step_line(m, cfg.pipeline.steps), markup=False, highlight=False, soft_wrap=True
            )
            bar.update(
                task, completed=m["step"], description=f"RL steps (reward {m['reward']:.3f})"
            )

        trainer.run(resume=args.resume, on_step=on_step, overwrite=args.overwrite)
    if common.console.is_terminal:  # off a terminal the step lines above are the record
        common.console.print(table)
    common.console.print(
        f"[green]done[/]: metrics.jsonl, report.md, checkpoints, policy/ and draft/ in "
        f"{cfg.pipeline.out_dir}"
    )


def add_parser(sub) -> None:
    """train"""
    tr = sub.add_parser("train", help="GRPO/DAPO training with speculative rollouts")
    tr.add_argument("--preset", default="default", help="default, tiny, or a YAML file")
    tr.add_argument(
        "--set", action="append", metavar="SECTION.KEY=VALUE", help="override (repeatable)"
    )
    tr.add_argument("--steps", type=int, help="shorthand for --set pipeline.steps=N")
    tr.add_argument("--out", help="shorthand for --set pipeline.out_dir=DIR")
    tr.add_argument(
        "--device",
        help="auto, cpu, cuda or cuda:N for rollouts and learner (shorthand for "
        "--set rollout.device=D --set learner.device=D; a --set overrides it per side)",
    )
    tr.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="rollout and learner dtype (shorthand for --set rollout.dtype=T --set "
        "learner.dtype=T)",
    )
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
