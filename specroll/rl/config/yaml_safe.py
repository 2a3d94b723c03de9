"""YAML as a run's settings are read and written: `--preset` / `--config` files and each
`--set` value.

PyYAML's safe loader builds no objects of its own (no `!!python` tags), but two of its
habits surprise a user, and a third lets a tiny file exhaust the machine:

* Numbers follow YAML 1.1: `010` is 8 (octal), `1:30` is 90 (sexagesimal), `1_000` is 1000,
  `0b11` is 3, while `3e-3` (no dot) is a string. Here numbers follow the YAML 1.2 core
  schema (what the YAML spec has said since 2009, and what most other tools read):
  decimal integers (`010` is 10), `0o` octal and `0x` hex, floats with or without a dot
  (`3e-3`, `1E3`, `.5`, `.inf`, `.nan`); anything else (`1:30`, `1_000`, `0b11`) is a
  string, which a numeric setting then refuses by name. Dates are strings too (YAML 1.2
  has no timestamps, and JSON cannot hold a date). Booleans keep YAML 1.1's spellings
  (`true`, `yes`, `on`, ...: `enable_thinking: off` is false, as users mean it).
* A key given twice in one mapping silently keeps the last: refused, naming the line.
* Aliases (`*name`) repeat what an anchor (`&name`) names without copying it in the
  text, so 300 bytes can name 10^9 values ("billion laughs"). The document is composed
  (nodes, shared by their aliases) and its expanded size counted before any Python
  object is built: aliases may add at most `MAX_ALIAS_EXPANSION` values and characters,
  and one that contains itself is refused. Nesting deeper than `MAX_NESTING` is refused
  too (the composer recurses once per level).
"""

from __future__ import annotations

import re

import yaml

MAX_ALIAS_EXPANSION = 10_000
"""Values and characters that aliases may add to a document beyond its own text: room
to reuse a few settings (an anchored section named twice), none to expand a bomb."""
MAX_NESTING = 64
"""Deepest nesting of lists and mappings in a document (a configuration needs three):
64 containers one inside another are read, 65 are not."""
MAX_NODES = 10_000
"""Values (scalars, lists and mappings) a document may write out, counted as it is
composed: a configuration holds a few hundred."""
CORE_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("int", "float", "timestamp")}
"""The implicit YAML 1.1 number and date resolvers that YAML 1.2 core ones replace."""
MERGE_TAG = "tag:yaml.org,2002:merge"
"""The `<<` key of a mapping that takes another's keys as defaults."""
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
"""YAML 1.2 core integers: decimal (leading zeros stay decimal), 0o octal, 0x hex."""
_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
"""YAML 1.2 core floats."""


class YAMLTooLarge(yaml.YAMLError):
    """A document whose aliases expand beyond `MAX_ALIAS_EXPANSION`, or contain
    themselves (the message says which; no marks)."""


def _core_resolvers() -> dict:
    """SafeLoader's implicit resolvers with YAML 1.2 core numbers and no timestamps."""
    out: dict = {}
    for first, pairs in yaml.SafeLoader.yaml_implicit_resolvers.items():
        out[first] = [(tag, rx) for tag, rx in pairs if tag not in CORE_TAGS]
    # integers first: `10` matches both patterns
    for tag, rx, firsts in (
        ("tag:yaml.org,2002:int", _INT, "-+0123456789"),
        ("tag:yaml.org,2002:float", _FLOAT, "-+.0123456789"),
    ):
        for first in firsts:
            out.setdefault(first, []).append((tag, rx))
    return out


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """A YAML 1.2 core integer (an explicit `!!int` of another form is refused)."""
    text = loader.construct_scalar(node)
    if not _INT.match(text):
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not a YAML 1.2 integer", node.start_mark
        )
    base = {"0o": 8, "0x": 16}.get(text[:2], 10)
    try:
        return int(text[2:] if base != 10 else text, base)
    except ValueError as e:  # more digits than Python converts (sys.get_int_max_str_digits)
        raise yaml.constructor.ConstructorError(None, None, str(e), node.start_mark) from None


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    """A YAML 1.2 core float (an explicit `!!float` of another form is refused)."""
    text = loader.construct_scalar(node)
    if not _FLOAT.match(text):
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not a YAML 1.2 number", node.start_mark
        )
    special = {".inf": "inf", ".nan": "nan"}.get(text.lower().lstrip("+-"))
    return float(text[0] + special if special and text[0] in "+-" else special or text)


def _expanded_size(root: yaml.Node) -> tuple[int, int]:
    """(size as written, size with every alias expanded) of a composed document, where a
    node's size is 1 (+ its characters, for a scalar); YAMLTooLarge when an alias
    contains itself. Linear in the distinct nodes: a shared node is counted once per
    use from its memoised size, never walked again."""
    memo: dict[int, int] = {}
    on_path: set[int] = set()
    written = 0

    def size(node: yaml.Node) -> int:
        nonlocal written
        key = id(node)
        if key in memo:
            return memo[key]
        if key in on_path:
            raise YAMLTooLarge(f"the alias at line {node.start_mark.line + 1} contains itself")
        if isinstance(node, yaml.ScalarNode):
            own = total = 1 + len(node.value)
        else:
            on_path.add(key)
            pairs = node.value if isinstance(node, yaml.MappingNode) else [(c,) for c in node.value]
            own, total = 1, 1 + sum(size(c) for pair in pairs for c in pair)
            on_path.discard(key)
        written += own
        memo[key] = total
        return total

    expanded = size(root)
    return written, expanded


class ConfigLoader(yaml.SafeLoader):
    """The safe loader with YAML 1.2 core numbers, a key given twice in one mapping
    refused (PyYAML keeps the last one silently, so a section written twice would lose
    the first's settings), and aliases bounded (module docstring)."""

    yaml_implicit_resolvers = _core_resolvers()
    _depth = 0
    """Lists and mappings open around the node being composed."""
    _nodes = 0
    """Nodes composed so far (aliases count once: `get_single_node` bounds their reuse)."""

    def compose_node(self, parent, index):
        # PyYAML composes recursively: 10^5 brackets would end in a RecursionError; and
        # it composes slowly: a 1 MiB list of numbers would take seconds before a refusal
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise YAMLTooLarge(
                f"more than {MAX_NODES} values (line {self.peek_event().start_mark.line + 1}); "
                "a configuration holds a few hundred"
            )
        container = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)
        if container and self._depth >= MAX_NESTING:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"lists and mappings nested more than {MAX_NESTING} deep",
                self.peek_event().start_mark,
            )
        self._depth += container
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= container

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            written, expanded = _expanded_size(node)
            if expanded - written > MAX_ALIAS_EXPANSION:
                raise YAMLTooLarge(
                    f"its aliases (*name) expand it by {expanded - written} values and "
                    f"characters, more than the {MAX_ALIAS_EXPANSION} allowed (an alias "
                    "bomb?); write the settings out instead"
                )
        return node

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == MERGE_TAG:  # `<<: *base`: its keys are the defaults here
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"{key!r} is given twice (first at line {seen[key]})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
ConfigLoader.add_constructor("tag:yaml.org,2002:float", _construct_float)


class ConfigDumper(yaml.SafeDumper):
    """The safe dumper that quotes what `ConfigLoader` would read as another type (a
    string '0o17' or '1e3' is written quoted), so `specroll config` output reads back as
    the same settings."""

    yaml_implicit_resolvers = _core_resolvers()


def load(text: str):
    """The Python value of one YAML document read by `ConfigLoader` (yaml.YAMLError,
    YAMLTooLarge among them, when it cannot be read)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader subclass)


def dump_inline(value) -> str:
    """One line of YAML for a value (lists and mappings in flow style)."""
    text = yaml.dump(value, Dumper=ConfigDumper, default_flow_style=True, width=1 << 16)
    return text.strip().removesuffix("...").strip()
