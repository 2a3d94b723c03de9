"""specroll command line: `specroll model | generate | bench | train | simulate | draft`
(see --help).

One module per sub-command, each with its `add_parser`; rich draws progress and tables.
Results (completions, `--json` reports, paths) go to stdout and everything else (progress,
timings, statistics, errors) to stderr, so `specroll generate > out.txt` captures the text.
"""

from __future__ import annotations

import argparse

from rich.text import Text

from specroll.cli import bench, common, draft, generate, simulate, train


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specroll", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    bench.add_parser(sub)
    train.add_parser(sub)
    simulate.add_parser(sub)
    draft.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        # soft_wrap: a long path stays one piece; Text: brackets in it are not markup
        common.console.print(Text.assemble(("error: ", "red"), str(e)), soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        common.console.print("[yellow]interrupted[/]")
        return 130
    except RuntimeError as e:
        from specroll.rl.learner.host import LearnerRankError

        if not isinstance(e, LearnerRankError):
            raise
        # a dead learner rank: the message names it and says how to continue
        common.console.print(Text.assemble(("error: ", "red"), str(e)), soft_wrap=True)
        return 1
    return 0
