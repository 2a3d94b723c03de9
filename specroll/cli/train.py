"""`specroll train`: GRPO/DAPO training with speculative rollouts."""

from __future__ import annotations

import argparse

from rich.table import Table

from specroll import outputs
from specroll.cli import common


def _config(args: argparse.Namespace):
    """The run's TrainConfig: the preset, then the shorthands, then every --set."""
    from specroll.rl.config import build_config

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
    return build_config(args.preset, overrides, tuple(args.config or ()))


def _plan(cfg, args: argparse.Namespace, budget: bool = True):
    """What the run may do in its directory, decided before any model is loaded or any
    file is written: a bad dataset, a device this machine lacks, a foreign or mismatched
    checkpoint, or an occupied output directory fail here; so does a setting that cannot
    fit the policy's context window or this machine's memory (`rl.budget`)."""
    from specroll.device import resolve_device
    from specroll.rl.budget import check_run
    from specroll.rl.run import rundir
    from specroll.rl.run.loggers import check_installed
    from specroll.rl.run.task import task_items

    outputs.check_dir(cfg.pipeline.out_dir, "--out")
    check_installed(cfg)  # a logger's missing package (wandb, mlflow) before any model
    with common.progress_bar() as bar:  # a large data file takes seconds
        reading: dict[str, int] = {}

        def on_read(name: str, done: int, total: int) -> None:
            if name not in reading:
                reading[name] = bar.add_task(f"reading {name} (lines)", total=total)
            bar.update(reading[name], completed=done, total=total)

        items = task_items(cfg, on_read)
    # (Ray workers and actors resolve theirs where they run)
    if cfg.rollout.backend == "local":
        resolve_device(cfg.rollout.device, "rollout.device")
    if cfg.learner_placement() == "local":
        resolve_device(cfg.learner.device, "learner.device")
    plan = rundir.check(
        cfg.pipeline.out_dir,
        cfg.to_dict(),
        cfg.pipeline.steps,
        args.resume,
        args.overwrite,
        allow_changed_inputs=args.allow_changed_inputs,
    )
    if cfg.lora.on:  # the rank and lora.init's adapter against the policy, unloaded
        from specroll.rl.run.adapters import check_dir

        check_dir(cfg, common.resolve_model_dir(cfg.policy.model))
    if budget and plan.action in ("fresh", "resume"):  # after the directory's verdict
        warning = check_run(cfg, items)
        if warning:
            common.console.print(f"warning: {warning}", markup=False, highlight=False)
    return plan


def _draft(cfg, policy, tok, path):
    """The draft the run starts from, with progress bars while a default one is built."""
    from specroll.rl.run.draft import build_draft

    with common.progress_bar() as bar:
        tasks: dict[str, int] = {}
        name = {"eagle3": "EAGLE-3", "mtp": "MTP"}.get(cfg.rollout.network, "the draft")
        # the unit in the label: the rate is rollouts/s or optimizer steps/s
        labels = {
            "data": "draft: sampling the policy (rollouts)",
            "train": f"draft: training {name} (steps)",
        }

        def on_draft(stage: str, done: int, total: int | None, info: str = "") -> None:
            label = labels.get(stage, stage)
            if stage not in tasks:
                tasks[stage] = bar.add_task(label, total=total)
            desc = f"{label} ({info})" if info else label
            bar.update(tasks[stage], completed=done, total=total, description=desc)

        return build_draft(cfg, policy, tok, path, progress=on_draft, log=common.log)


COLUMNS = (
    "step",
    "reward",
    "val reward",
    "resp len",
    "AL",
    "gen s",
    "logprob s",
    "train s",
    "tok/s",
)
"""The summary table printed at the end of a run on a terminal."""


def _row(m: dict) -> list[str]:
    """A step's row of the summary table."""
    t, al = m["time"], m["acceptance_length"]
    return [
        str(m["step"]),
        f"{m['reward']:.3f}",
        "" if "val_accuracy" not in m else f"{m['val_accuracy']:.3f}",
        f"{m['response_len_mean']:.0f}",
        "-" if al is None else f"{al:.2f}",
        f"{t['gen']:.1f}",
        f"{t['logprob']:.1f}",
        f"{t['train']:.1f}",
        f"{m['gen_tok_s']:.0f}",
    ]


def cmd_train(args: argparse.Namespace) -> None:
    cfg = _config(args)
    plan = _plan(cfg, args)
    if plan.action == "finished":
        common.console.print(
            plan.finished_message(cfg.pipeline.out_dir, cfg.pipeline.steps),
            markup=False,
            highlight=False,
        )
        return
    with outputs.DirLock(cfg.pipeline.out_dir):
        plan = _plan(cfg, args, budget=False)  # again, under the lock: another run may have begun
        _train(args, cfg, plan)


def _train(args: argparse.Namespace, cfg, plan) -> None:
    """Load the policy, build its draft and the trainer, and run the planned steps."""
    from specroll.rl.run.adapters import check_dir
    from specroll.rl.run.report import step_line
    from specroll.rl.run.trainer import Trainer

    path = common.resolve_model_dir(cfg.policy.model)
    check_dir(cfg, path)  # lora.*: the rank and lora.init's adapter against it, unloaded
    policy, tok = common.load_dir(path)
    draft = _draft(cfg, policy, tok, path)
    trainer = Trainer(cfg, policy, tok, draft, log=common.log)
    common.console.print(
        f"[bold]specroll train[/] preset={args.preset} model={cfg.policy.model} "
        f"steps={cfg.pipeline.steps} speculative={cfg.rollout.speculative} "
        f"out={cfg.pipeline.out_dir}"
    )
    table = Table(title="RL steps")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    with common.progress_bar() as bar:
        task = bar.add_task("RL steps", total=cfg.pipeline.steps, completed=trainer.step)

        def on_step(m: dict) -> None:
            if "time" not in m:
                return
            table.add_row(*_row(m))
            common.console.print(
                step_line(m, cfg.pipeline.steps), markup=False, highlight=False, soft_wrap=True
            )
            bar.update(
                task, completed=m["step"], description=f"RL steps (reward {m['reward']:.3f})"
            )

        try:
            trainer.run(on_step=on_step, plan=plan)
        finally:  # every exit path: the learner's ranks and the reward worker end with it
            trainer.close()
    if common.console.is_terminal:  # off a terminal the step lines above are the record
        common.console.print(table)
    common.console.print(
        f"[green]done[/]: metrics.jsonl, report.md, checkpoints, policy/ and draft/ in "
        f"{cfg.pipeline.out_dir}"
    )


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The arguments that make a run's configuration, in the order they apply: the
    preset, each --config file over it, the shorthands, then each --set."""
    p.add_argument(
        "--preset",
        default="default",
        help="default, tiny, or a YAML file of every setting (fields it omits take the "
        "dataclass defaults; to change a few settings of a preset use --config)",
    )
    p.add_argument(
        "--config",
        action="append",
        metavar="FILE",
        help="YAML file layered over the preset: the fields it sets replace the preset's, "
        "the rest stay (repeatable, later files win)",
    )
    p.add_argument(
        "--set", action="append", metavar="SECTION.KEY=VALUE", help="override (repeatable)"
    )
    p.add_argument("--steps", type=int, help="shorthand for --set pipeline.steps=N")
    p.add_argument("--out", help="shorthand for --set pipeline.out_dir=DIR")
    p.add_argument(
        "--device",
        help="auto, cpu, cuda or cuda:N for rollouts and learner (shorthand for "
        "--set rollout.device=D --set learner.device=D; a --set overrides it per side)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="rollout and learner dtype (shorthand for --set rollout.dtype=T --set "
        "learner.dtype=T)",
    )


def add_parser(sub) -> None:
    """train"""
    tr = sub.add_parser(
        "train",
        help="GRPO/DAPO training with speculative rollouts",
        description="GRPO/DAPO training with speculative rollouts. `specroll config` with "
        "the same --preset/--config/--set prints the resolved configuration, every field "
        "with its documentation.",
    )
    add_config_args(tr)
    tr.add_argument(
        "--resume", action="store_true", help="continue this run from its latest checkpoint"
    )
    tr.add_argument(
        "--allow-changed-inputs",
        action="store_true",
        help="with --resume: continue although the data files or reward code changed since "
        "the run began (without it such a resume is refused, naming what changed)",
    )
    tr.add_argument(
        "--overwrite",
        action="store_true",
        help="start a fresh run in an --out that holds another run (deletes its metrics, "
        "checkpoints and outputs)",
    )
    tr.set_defaults(func=cmd_train)
