"""`specroll config`: the configuration a `specroll train` would run with, resolved from
the same --preset / --config / --set, printed as YAML with each section's and field's
documentation as comments. The output is itself a valid --config file, so
`specroll config --preset tiny > mine.yaml` is a starting point to edit."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from specroll.cli import train


def _plain(value: Any) -> Any:
    """A value YAML's safe dumper can write (tuples as lists)."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _inline(value: Any) -> str:
    """One line of YAML for a value (lists and mappings in flow style), quoted where the
    settings' reader would take it for another type."""
    from specroll.rl.config.yaml_safe import dump_inline

    return dump_inline(_plain(value))


def _comment(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}".rstrip() for line in text.splitlines()]


def render(cfg, header: str = "") -> str:
    """The YAML text of a TrainConfig, documented field by field."""
    from specroll.rl.config import SECTIONS
    from specroll.rl.config.io import field_docs

    lines = _comment(header, "") + [""] if header else []
    for name, cls in SECTIONS.items():
        section_doc, docs = field_docs(cls)
        lines += _comment(section_doc, "") + [f"{name}:"]
        for f in dataclasses.fields(cls):
            lines += _comment(docs.get(f.name, ""), "  ")
            lines.append(f"  {f.name}: {_inline(getattr(getattr(cfg, name), f.name))}")
        lines.append("")
    return "\n".join(lines)


def cmd_config(args: argparse.Namespace) -> None:
    cfg = train._config(args)
    parts = [f"preset {args.preset}"] + [f"--config {c}" for c in args.config or ()]
    if args.set:
        parts.append(" ".join(f"--set {s}" for s in args.set))
    header = "specroll train configuration: " + ", ".join(parts)
    sys.stdout.write(render(cfg, header))


def add_parser(sub) -> None:
    """config"""
    p = sub.add_parser(
        "config",
        help="print the resolved training configuration with each field's documentation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_config_args(p)
    p.set_defaults(func=cmd_config)
