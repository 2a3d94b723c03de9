"""Progress that shows up wherever the output goes: rich bars in a terminal, lines elsewhere.

rich's transient bars and `console.status` spinners draw nothing when the console is not
a terminal, so `specroll train > log 2>&1` (a cluster job, nohup, CI) stayed silent for the
hour of draft sampling and training. `progress(console)` returns rich's `Progress` in a
terminal and a `PlainProgress` otherwise; both take the same calls (`add_task`, `update`,
`advance`, `with`), so callers never branch. `PlainProgress` prints a line when a task
starts, at every 10% of its total, at least every `every` seconds while it advances (a
heartbeat for tasks without a total), and when it ends. `status(console, text)` is the
same for spinners: the spinner in a terminal, one start line and one end line elsewhere.

The heartbeat interval is `SPECROLL_PROGRESS_EVERY` seconds (default 10).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

EVERY_ENV = "SPECROLL_PROGRESS_EVERY"
"""Environment variable: seconds between heartbeat lines off a terminal."""
DEFAULT_EVERY = 10.0
"""Heartbeat seconds when EVERY_ENV is unset."""


def progress(console: Console, every: float | None = None) -> Progress | PlainProgress:
    """Transient rich bars when `console` is a terminal, else plain lines on `console`."""
    if console.is_terminal:
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
    return PlainProgress(console, every_seconds() if every is None else every)


@contextmanager
def status(console: Console, text: str, clock: Callable[[], float] = time.monotonic) -> Iterator:
    """`console.status(text)` in a terminal; off one, a start line and a timed end line."""
    if console.is_terminal:
        with console.status(text) as spinner:
            yield spinner
        return
    _say(console, f"{text} ...")
    t0 = clock()
    yield None
    _say(console, f"{text}: done in {_duration(clock() - t0)}")


def every_seconds() -> float:
    """The heartbeat interval: $SPECROLL_PROGRESS_EVERY, else DEFAULT_EVERY."""
    text = os.environ.get(EVERY_ENV, "").strip()
    if not text:
        return DEFAULT_EVERY
    try:
        every = float(text)
    except ValueError:
        every = -1.0
    if not every >= 0:  # also rejects nan
        raise ValueError(f"{EVERY_ENV} must be a number of seconds >= 0, got {text!r}")
    return every


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float
    started: float
    printed: float
    """Clock of the last line printed for this task."""
    tenth: int
    """Tenths of the total already reported."""
    finished: bool = False


class PlainProgress:
    """rich `Progress`'s calls, printed as lines (for consoles that are not terminals)."""

    def __init__(
        self,
        console: Console,
        every: float = DEFAULT_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console, self.every, self.clock = console, every, clock
        self._tasks: dict[int, _Task] = {}

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        for tid in list(self._tasks):
            self._end(tid)

    def add_task(
        self,
        description: str,
        total: float | None = 100.0,
        completed: float = 0,
        **_: Any,
    ) -> int:
        """Start a task (prints its start line); returns its id."""
        tid = len(self._tasks)
        now = self.clock()
        task = _Task(description, total, completed, now, now, 0)
        task.tenth = self._tenth(task)
        self._tasks[tid] = task
        of = "" if total is None else f" (total {_num(total)})"
        at = f", from {_num(completed)}" if completed else ""
        _say(self.console, f"{description}: started{of}{at}")
        return tid

    def update(
        self,
        task_id: int,
        *,
        total: float | None = None,
        completed: float | None = None,
        advance: float | None = None,
        description: str | None = None,
        **_: Any,
    ) -> None:
        """Change a task as rich does (None leaves a field as it is); may print a line."""
        task = self._tasks[task_id]
        if task.finished:
            return
        if description is not None:
            task.description = description
        if total is not None:
            task.total = total
        if completed is not None:
            task.completed = completed
        if advance is not None:
            task.completed += advance
        if task.total is not None and task.completed >= task.total:
            self._end(task_id)
            return
        now, tenth = self.clock(), self._tenth(task)
        if tenth > task.tenth or now - task.printed >= self.every:
            task.tenth = max(task.tenth, tenth)
            task.printed = now
            _say(self.console, f"{task.description}: {self._where(task, now)}")

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def _end(self, task_id: int) -> None:
        task = self._tasks[task_id]
        if task.finished:
            return
        task.finished = True
        done = task.total is not None and task.completed >= task.total
        word = "done" if done else "stopped at"
        _say(self.console, f"{task.description}: {word} {self._where(task, self.clock())}")

    @staticmethod
    def _tenth(task: _Task) -> int:
        if not task.total:
            return 0
        return int(10 * min(task.completed / task.total, 1.0))

    @staticmethod
    def _where(task: _Task, now: float) -> str:
        """'40/100 (40%), 2.1/s, 19s elapsed, ~29s left'."""
        elapsed = now - task.started
        parts = [_num(task.completed)]
        if task.total:
            parts[0] += f"/{_num(task.total)} ({100 * task.completed / task.total:.0f}%)"
        rate = task.completed / elapsed if elapsed > 0 else 0.0
        if rate > 0:
            parts.append(f"{rate:.3g}/s")
        parts.append(f"{_duration(elapsed)} elapsed")
        if task.total and rate > 0 and task.completed < task.total:
            parts.append(f"~{_duration((task.total - task.completed) / rate)} left")
        return ", ".join(parts)


def _say(console: Console, line: str) -> None:
    """One plain line: no markup, no highlighting, no wrapping (log files are grepped)."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.3g}"


def _duration(seconds: float) -> str:
    """'4.2s', '3m05s', '1h02m'."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
