"""Progress reaches logs: plain lines when the console is not a terminal (issue 13, item 8)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.progress import Progress

from specroll import progress as progress_mod
from specroll.progress import PlainProgress, progress, status


def _log_console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=False, width=60), buf


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_terminal_gets_rich_bars_and_a_log_gets_lines():
    assert isinstance(progress(Console(file=io.StringIO(), force_terminal=True)), Progress)
    console, buf = _log_console()
    bar = progress(console, every=10)
    assert isinstance(bar, PlainProgress)
    with bar:
        task = bar.add_task("sampling the policy", total=20)
        for _ in range(20):
            bar.advance(task)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "sampling the policy: started (total 20)"
    assert lines[-1].startswith("sampling the policy: done 20/20 (100%)")
    assert len(lines) == 1 + 9 + 1  # start, 10% .. 90%, done
    assert lines[1].startswith("sampling the policy: 2/20 (10%), ")


def test_heartbeat_every_n_seconds_and_end_line_without_total():
    console, buf = _log_console()
    clock = Clock()
    with PlainProgress(console, every=10, clock=clock) as bar:
        task = bar.add_task("training draft", total=None)
        for step in range(1, 30):
            clock.t += 1
            bar.update(task, completed=step, description=f"training draft  loss {1 / step:.2f}")
    lines = buf.getvalue().splitlines()
    assert lines[0] == "training draft: started"
    assert lines[1] == "training draft  loss 0.10: 10, 1/s, 10.0s elapsed"
    assert lines[2] == "training draft  loss 0.05: 20, 1/s, 20.0s elapsed"
    assert lines[-1] == "training draft  loss 0.03: stopped at 29, 1/s, 29.0s elapsed"
    assert len(lines) == 4


def test_the_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SPECROLL_PROGRESS_EVERY", "2.5")
    assert progress(_log_console()[0]).every == 2.5
    monkeypatch.delenv("SPECROLL_PROGRESS_EVERY")
    assert progress_mod.every_seconds() == progress_mod.DEFAULT_EVERY
    monkeypatch.setenv("SPECROLL_PROGRESS_EVERY", "soon")
    with pytest.raises(ValueError, match="SPECROLL_PROGRESS_EVERY"):
        progress(_log_console()[0])


def test_status_prints_a_start_line_off_a_terminal():
    console, buf = _log_console()
    clock = Clock()
    with status(console, "loading /models/tiny", clock=clock):
        clock.t = 3
    assert buf.getvalue().splitlines() == [
        "loading /models/tiny ...",
        "loading /models/tiny: done in 3.0s",
    ]


def test_a_command_logs_its_progress_when_not_a_terminal(monkeypatch, tmp_path):
    """`specroll generate > log 2>&1`: the log shows loading and generation progress."""
    from specroll.cli import common, main

    console, buf = _log_console()
    monkeypatch.setattr(common, "console", console)
    monkeypatch.setenv("SPECROLL_HOME", str(tmp_path))
    argv = ["generate", "--model", "tiny", "--max-new-tokens", "4", "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    log = buf.getvalue()
    assert "loading " in log and "generating: started (total 8)" in log
    assert "generating: done 8/8 (100%)" in log
