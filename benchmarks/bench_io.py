"""What every benchmark script reads from its user, checked before any work: an ordinary
mistake (a missing output directory, a malformed NAME=DIR, a damaged metrics line) is
one line naming the argument or the file, and exit status 2, never a traceback.

    from bench_io import Parser, output, run_spec, metrics_rows
    ap = Parser(description=...)
    ap.add_argument("--out", type=output, default="")
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """argparse, whose errors are one line (`prog: message`, exit 2) without the usage."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {message}\n")
        sys.exit(2)


def fail(message: str) -> NoReturn:
    """One line on stderr naming the script, and exit status 2."""
    sys.stderr.write(f"{Path(sys.argv[0]).name}: {message}\n")
    sys.exit(2)


def output(value: str) -> str:
    """An argparse type for a file the script will write ('' = none): its directory must
    exist and be writable now, not after minutes of measuring."""
    if not value:
        return value
    p = Path(value).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is a directory, not a file to write")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r}: the directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(
            f"{value!r}: the directory {str(parent)!r} is not writable"
        )
    return str(p)


def run_spec(spec: str, seconds: bool = False) -> tuple[str, Path, float]:
    """NAME=RUN_DIR (NAME=RUN_DIR@SECONDS with `seconds`) → (name, run directory, seconds
    or 0); one line and exit 2 for anything else."""
    form = "NAME=RUN_DIR[@SECONDS]" if seconds else "NAME=RUN_DIR"
    name, eq, rest = spec.partition("=")
    path, at, secs = rest.partition("@") if seconds else (rest, "", "")
    if not eq or not name or not path:
        fail(f"expected {form}, got {spec!r}")
    try:
        build = float(secs) if at else 0.0
    except ValueError:
        fail(f"expected {form} with SECONDS a number, got {spec!r}")
    if not 0 <= build < float("inf"):
        fail(f"expected {form} with SECONDS >= 0, got {spec!r}")
    if not (Path(path) / "metrics.jsonl").is_file():
        fail(f"{spec!r}: {Path(path) / 'metrics.jsonl'} does not exist (not a run directory)")
    return name, Path(path), build


def metrics_rows(run_dir: Path) -> list[dict]:
    """The JSON objects of `run_dir/metrics.jsonl`; a line that is not one is named with
    its number (a last line cut short by a crash is left out, as the run does)."""
    f = run_dir / "metrics.jsonl"
    try:
        lines = f.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        fail(f"{f}: cannot be read ({e})")
    rows = []
    for i, line in enumerate(lines[:-1], 1):  # the part after the last newline is unfinished
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            fail(f"{f}:{i}: not a JSON line ({e.msg}); is the file damaged?")
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            fail(f"{f}:{i}: not a metrics line (a JSON object with an integer 'step')")
        rows.append(row)
    return rows


def run_config(run_dir: Path) -> dict:
    """`run_dir/config.json` (the run's settings) or {} when it has none or it is damaged."""
    try:
        out = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}
