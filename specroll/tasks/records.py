"""A JSONL file's problems, kept as the file's own bytes and built when a run uses them.

A data file of a million records read into a million `Problem`s (each with its record's
dict) held 1.3 GB, though a run uses the few dozen prompts of its steps. Here the file is
read once, every record is checked (so a bad one is still refused before any model
loads), and what is kept is the file's bytes, where each record's line starts and ends,
and what the run's checks need of each record without building it (`Shapes`: whether it
has an answer, the bytes and messages of its prompt): about 70 MB for a million records.
A problem is built again from its line when it is asked for, identical to the one the
check built (the same parser, the same line).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, overload

from specroll.tasks.arithmetic import Problem


@dataclass
class Shapes:
    """What budgets and checks need of each record, one entry a record."""

    answered: bytearray = field(default_factory=bytearray)
    """1 where the record has an answer."""
    text: array = field(default_factory=lambda: array("q"))
    """UTF-8 bytes of its messages' contents (its prompt's, without a chat)."""
    messages: array = field(default_factory=lambda: array("l"))
    """Its messages (1 for a prompt given as text)."""
    system: bytearray = field(default_factory=bytearray)
    """1 where its first message is a system message."""

    def add(self, p: Problem) -> None:
        msgs = p.messages or ({"role": "user", "content": p.prompt},)
        self.answered.append(bool(p.answer))
        self.text.append(sum(len(m["content"].encode()) for m in msgs))
        self.messages.append(len(msgs))
        self.system.append(msgs[0].get("role") == "system")


@dataclass
class Lines:
    """A file's bytes and its records' lines in them."""

    data: bytes
    starts: array = field(default_factory=lambda: array("q"))
    ends: array = field(default_factory=lambda: array("q"))
    numbers: array = field(default_factory=lambda: array("q"))
    """Line number (1-based) of each record, for its uid 'file:line'."""


class FileProblems(Sequence[Problem]):
    """The problems of one JSONL file (or a slice of them), each built on access by
    `build(text of its line, line number)`."""

    def __init__(
        self,
        lines: Lines,
        shapes: Shapes,
        build: Callable[[str, int], Problem],
        span: range | None = None,
    ) -> None:
        self.lines, self.shapes, self.build = lines, shapes, build
        self.span = range(len(lines.starts)) if span is None else span

    def __len__(self) -> int:
        return len(self.span)

    @overload
    def __getitem__(self, i: int) -> Problem: ...
    @overload
    def __getitem__(self, i: slice) -> FileProblems: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return FileProblems(self.lines, self.shapes, self.build, self.span[i])
        j = self.span[i]
        ln = self.lines
        text = ln.data[ln.starts[j] : ln.ends[j]].decode("utf-8")
        return self.build(text, ln.numbers[j])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]


def missing_answers(items: Iterable[Problem], n: int = 5) -> list[str]:
    """The uids of the first `n` problems without an answer."""
    if isinstance(items, FileProblems):
        answered = items.shapes.answered
        missing = (k for k, j in enumerate(items.span) if not answered[j])
        return [items[k].uid for k in islice(missing, n)]
    return [p.uid for p in items if not p.answer][:n]


def prompt_bytes(
    items: Iterable[Problem] | Sequence[Any], system_prompt: str, per_message: int
) -> int:
    """The largest of the problems' prompts in bytes, as `limits.prompt_tokens` bounds
    them: their messages' contents, `system_prompt` where a problem has no system message
    of its own, its reply's prefix and `per_message` for each message after the first;
    0 for none. `items` may be a `Joined`; a `FileProblems` is measured from its
    `Shapes`, without building a problem."""
    if isinstance(items, Joined):
        return max((prompt_bytes(p, system_prompt, per_message) for p in items.parts), default=0)
    if isinstance(items, FileProblems):
        s, span = items.shapes, items.span
        prefix = len(items[0].response_prefix.encode()) if span else 0
        prefixes = [prefix] * len(span)
    else:
        s, prefixes = Shapes(), []
        for p in items:
            s.add(p)
            prefixes.append(len(p.response_prefix.encode()))
        span = range(len(prefixes))
    extra, best = len(system_prompt.encode()), 0
    for j, prefix in zip(span, prefixes, strict=True):
        n, size = s.messages[j], s.text[j]
        if system_prompt and not s.system[j]:  # the system prompt goes first
            n, size = n + 1, size + extra
        best = max(best, size + prefix + per_message * (n - 1))
    return best


class Joined(Sequence[Problem]):
    """Several sequences of problems read as one (a run's training and validation files),
    none copied."""

    def __init__(self, parts: list[Sequence[Problem]]) -> None:
        self.parts = parts

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        if i < 0:
            i += len(self)
        for p in self.parts:
            if i < len(p):
                return p[i]
            i -= len(p)
        raise IndexError(i)
