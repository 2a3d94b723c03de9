"""specroll command line: `specroll generate | bench | train | simulate | draft | config |
export`
(see --help).

One module per sub-command, each with its `add_parser`; rich draws progress and tables.
Results (completions, `--json` reports, paths) go to stdout and everything else (progress,
timings, statistics, errors) to stderr, so `specroll generate > out.txt` captures the text.
"""

from __future__ import annotations

import argparse
import signal

from rich.text import Text

from specroll.cli import bench, common, config, draft, export, generate, simulate, train
from specroll.rl.errors import RunError, Stopped


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specroll", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    bench.add_parser(sub)
    train.add_parser(sub)
    simulate.add_parser(sub)
    draft.add_parser(sub)
    config.add_parser(sub)
    export.add_parser(sub)
    return p


def _stop_on_sigterm(signum, frame) -> None:
    """SIGTERM (what schedulers and `timeout` send) ends a command as Ctrl-C does; a
    training run's own handler saves a checkpoint first (`rl.run.rundir`)."""
    raise Stopped(signum, "stopped by SIGTERM")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        args.func(args)
    except ValueError as e:
        # soft_wrap: a long path stays one piece; Text: brackets in it are not markup
        common.console.print(Text.assemble(("error: ", "red"), str(e)), soft_wrap=True)
        return 2
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        common.console.print(
            Text.assemble(("interrupted", "yellow"), f": {e}" if str(e) else ""), soft_wrap=True
        )
        return 128 + signum
    except RunError as e:
        # a dead learner rank, a non-finite update, a checkpoint that could not be
        # written: the message says what happened and how to continue
        common.console.print(Text.assemble(("error: ", "red"), str(e)), soft_wrap=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
