"""Checkpoints of a training run: everything needed to continue exactly, verified on load.

A checkpoint holds the policy and draft weights, both optimizers, the RNG states, the
step (which is also the data cursor: prompts and rollout seeds are functions of the
step) and the config. Beside the state, `meta.json` holds the step, the id of the run
that wrote it, its config, and the size and SHA-256 of every file, so a resume can be
checked without loading any weights (see `rundir`) and a damaged checkpoint (truncated,
emptied, overwritten) is recognised and skipped for the previous one. It is written to a
temporary directory and renamed, so a crash mid-write never leaves a half checkpoint
behind; a write that fails (a full disk) removes its temporary directory and keeps the
previous checkpoints. Only the newest `keep` are kept.

A training run writes them in the background (`Writer`): the state is snapshotted at the
step's end and written while the next step runs, so a checkpoint costs the step a copy
of the state in memory rather than its serialisation and checksums.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import random
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from specroll.model.untrusted import UnreadableFile, load_tensors
from specroll.rl.errors import CheckpointError

FORMAT = 2
"""The checkpoint layout written here (`meta.json`'s `format`); 1 = specroll before the
rl/ split, whose checkpoints carry no format (they do not resume: start over)."""


def _final(root: Path, step: int) -> Path:
    """Where checkpoint `step` lies once written."""
    return root / f"step-{step:06d}"


def _dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step-*") if p.is_dir())


def latest(root: str | Path) -> Path | None:
    """Newest checkpoint directory under `root` (whether or not it is intact), or None."""
    found = _dirs(Path(root))
    return found[-1] if found else None


def sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 4 MiB chunks (memory stays flat)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _files(directory: Path) -> dict[str, dict]:
    """{relative path: {bytes, sha256}} of every file under `directory` but meta.json."""
    return {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != "meta.json"
    }


def snapshot(state: Any) -> Any:
    """A copy of `state` that later training cannot change: every tensor cloned on the
    CPU, containers rebuilt (a CPU learner's `checkpoint_state` holds its live tensors)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    return copy.deepcopy(state)


def save(
    root: str | Path,
    step: int,
    state: dict[str, Any],
    keep: int = 2,
    run_id: str = "",
    write: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint `step` (state: tensors/optimizer dicts/config) atomically, now.

    write: also writes into the checkpoint's directory (a sharded learner's DCP state)."""
    return _finish(*_begin(Path(root), step, state, write), keep, run_id)


def _begin(root: Path, step: int, state: dict, write: Callable[[Path], None] | None) -> tuple:
    """What must happen at the moment of the checkpoint: the RNG states taken, the
    temporary directory made, and what `write` writes (a sharded learner's ranks take
    part, so it cannot wait) → (root, step, state with the RNG states, tmp)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):  # left by a process killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step-{step:06d}"
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    with _failing_write(root, step, tmp):
        tmp.mkdir()
        if write is not None:
            write(tmp)
    return root, step, {**state, "step": step, "rng": rng}, tmp


def _finish(root: Path, step: int, state: dict, tmp: Path, keep: int, run_id: str) -> Path:
    """The rest of a checkpoint (`_begin`): state.pt, meta.json with every file's size and
    checksum, the rename that makes it whole, the oldest beyond `keep` removed."""
    final = _final(root, step)
    with _failing_write(root, step, tmp):
        torch.save(state, tmp / "state.pt")
        meta = {
            "format": FORMAT,
            "step": step,
            "run_id": run_id,
            "config": state["config"],
            "files": _files(tmp),
        }
        (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in _dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


@contextlib.contextmanager
def _failing_write(root: Path, step: int, tmp: Path) -> Iterator[None]:
    """A write that fails leaves no half checkpoint: its temporary directory goes, and a
    full disk (OSError; torch.save's RuntimeError) is a `CheckpointError` that names the
    checkpoint kept."""
    try:
        yield
    except BaseException as e:  # a second Ctrl-C mid-write too: no half checkpoint stays
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, (OSError, RuntimeError)):
            raise
        kept = latest(root)
        raise CheckpointError(
            f"could not write checkpoint {_final(root, step)}: "
            f"{getattr(e, 'strerror', None) or e}"
            + (f"; the previous one ({kept.name}) is kept" if kept else "")
        ) from e


def _yield_cores() -> None:
    """Lower the calling thread's priority to the least (Linux: a thread is a task whose
    niceness is its own): a write in the background takes the cores only when training
    leaves them idle, instead of slowing every product it shares them with (measured on
    2 cores: a 384 MB save beside matrix products slowed them 2.4x; at nice 19, 5 %).
    Elsewhere nothing."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class Writer:
    """Checkpoints written in the background, one at a time, off the training step's
    critical path: `start` takes what must be taken at once (a snapshot of the state, the
    RNG states, a sharded learner's files) and returns; a thread writes the rest with
    every guarantee of `save` (atomic, checksummed, a failed write keeps the previous
    checkpoint). The next `start`, and `wait`, wait for the write in flight and raise
    its `CheckpointError`, if any. The thread is not a daemon: an interpreter that exits
    (a signal's `Stopped` included) finishes the write first."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.path: Path | None = None
        """The checkpoint in flight, or the last one written."""

    def start(
        self,
        root: str | Path,
        step: int,
        state: dict[str, Any],
        keep: int = 2,
        run_id: str = "",
        write: Callable[[Path], None] | None = None,
    ) -> Path:
        """Begin checkpoint `step` (as `save`) and return the path it will have."""
        self.wait()
        begun = _begin(Path(root), step, snapshot(state), write)
        self.path = _final(Path(root), step)

        def run() -> None:
            _yield_cores()
            try:
                _finish(*begun, keep, run_id)
            except BaseException as e:  # handed to the main thread at its next wait
                self._error = e

        self._thread = threading.Thread(target=run, name=f"checkpoint-{step}")
        self._thread.start()
        return self.path

    def wait(self) -> Path | None:
        """Wait for the write in flight (none: return at once) → the newest checkpoint
        this writer wrote; raise what made the write fail."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error, self.path = self._error, None, None
            raise error
        return self.path


def meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's {format, step, run_id, config, files}, without its tensors."""
    f = Path(path) / "meta.json"
    try:
        out = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{f}: unreadable ({getattr(e, 'strerror', None) or e})") from e
    if not isinstance(out, dict) or not {"step", "run_id", "config"} <= out.keys():
        raise ValueError(f"{f}: not a checkpoint's meta.json (step, run_id, config missing)")
    return out


def damage(path: str | Path) -> str | None:
    """Why checkpoint `path` cannot be loaded (meta.json unreadable, a file missing, of
    the wrong size or content), or None when it is intact. Reads every file once."""
    path = Path(path)
    try:
        m = meta(path)
    except ValueError as e:
        return str(e)
    if m.get("format") != FORMAT:
        return None  # another layout: `rundir.check` refuses it by name
    for name, want in m.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"{f} is {size} bytes, meta.json says {want['bytes']}"
        if sha256(f) != want["sha256"]:
            return f"{f} does not match its checksum in meta.json"
    if "state.pt" not in m.get("files", {}):
        return f"{path / 'meta.json'} lists no state.pt"
    return None


def newest_intact(root: str | Path) -> tuple[Path | None, list[str]]:
    """The newest intact checkpoint under `root` (or None), and a line for each newer one
    skipped as damaged, saying why."""
    skipped = []
    for path in reversed(_dirs(Path(root))):
        why = damage(path)
        if why is None:
            return path, skipped
        skipped.append(f"skipped the damaged checkpoint {path.name}: {why}")
    return None, skipped


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint and restore the global RNG states it saved. Tensors, numbers,
    strings and containers only (`load_tensors`): a checkpoint from elsewhere cannot run
    code when it is loaded, and one that asks to, or lacks what a checkpoint holds, is
    refused in one line naming its state.pt (`UnreadableFile`)."""
    f = Path(path) / "state.pt"
    state = load_tensors(f)
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise UnreadableFile(f"{f}: not a specroll checkpoint's state (no config)")
    try:
        step, rng = int(state["step"]), state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UnreadableFile(
            f"{f}: not a specroll checkpoint's state (its step or RNG states: {e})"
        ) from None
    state["step"] = step
    state["path"] = str(path)  # where a sharded learner state lies (`learner/`)
    return state
