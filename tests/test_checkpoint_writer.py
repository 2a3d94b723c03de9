"""Checkpoints written in the background (`checkpoint.Writer`) keep every guarantee of a
checkpoint written on the critical path: the state of their moment, atomic and
checksummed, a failed write keeping the previous one, one write at a time, and a process
that ends mid-write finishing it first."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from specroll.rl.run import checkpoint


def _state(value: float) -> dict:
    return {"config": {"pipeline": {"seed": 0}}, "w": torch.full((64, 64), value)}


def test_a_background_checkpoint_holds_the_state_of_its_moment(tmp_path):
    root, state = tmp_path / "checkpoints", _state(1.0)
    writer = checkpoint.Writer()
    path = writer.start(root, 3, state)
    state["w"].add_(5.0)  # the next step trains on while the write runs
    assert writer.wait() == path == root / "step-000003"
    assert checkpoint.damage(path) is None  # every file's size and checksum as listed
    loaded = checkpoint.load(path)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], torch.full((64, 64), 1.0))
    assert sorted(p.name for p in root.iterdir()) == ["step-000003"]  # no temporary left


def test_a_background_write_that_fails_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    checkpoint.save(root, 1, _state(1.0))
    writer = checkpoint.Writer()

    def disk_full(obj, f, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    writer.start(root, 2, _state(2.0))  # returns: the failure comes with the next wait
    with pytest.raises(checkpoint.CheckpointError, match="No space left.*step-000001.*kept"):
        writer.wait()
    assert sorted(p.name for p in root.iterdir()) == ["step-000001"]
    assert checkpoint.damage(root / "step-000001") is None
    assert writer.wait() is None  # the error is raised once


def test_the_next_checkpoint_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    root, order = tmp_path / "checkpoints", []
    finish = checkpoint._finish

    def slow(root, step, *args):
        time.sleep(0.3)
        order.append(step)
        return finish(root, step, *args)

    monkeypatch.setattr(checkpoint, "_finish", slow)
    writer = checkpoint.Writer()
    writer.start(root, 1, _state(1.0), keep=1)
    writer.start(root, 2, _state(2.0), keep=1)  # waits for step 1's write first
    assert order == [1]
    writer.wait()
    assert order == [1, 2] and sorted(p.name for p in root.iterdir()) == ["step-000002"]


def test_a_process_that_ends_mid_write_finishes_the_write(tmp_path):
    """A signal's `Stopped` (a KeyboardInterrupt) ends the process while a checkpoint is
    being written: the interpreter finishes the write before it exits."""
    root = tmp_path / "checkpoints"
    script = textwrap.dedent(
        f"""
        import time, torch
        from specroll.rl.run import checkpoint
        finish = checkpoint._finish
        def slow(*args):
            time.sleep(1.0)
            return finish(*args)
        checkpoint._finish = slow
        checkpoint.Writer().start({str(root)!r}, 5, {{"config": {{}}, "w": torch.ones(8)}})
        raise KeyboardInterrupt
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr
    assert sorted(p.name for p in root.iterdir()) == ["step-000005"]
    assert checkpoint.damage(root / "step-000005") is None
