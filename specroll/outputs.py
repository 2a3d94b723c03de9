"""Where commands write: checked before any work starts, held by one process at a time,
written whole.

* `check_file` / `check_dir`: an output path is usable (not the wrong kind of thing, on a
  writable file system) before a model is loaded or a sample generated, so a bad `--out`
  fails in a second instead of after the work; the check writes a probe file into the
  nearest existing directory and removes it, so a path that does not exist yet stays so.
* `DirLock`: an exclusive `flock` on `DIR/.lock`, held while a command writes into DIR;
  a second command fails at once, naming the process that holds it. The kernel drops the
  lock when its process ends (even when killed), so a stale lock file blocks nothing.
* `atomic_path` / `write_text` / `append_line`: a file appears whole or not at all (a
  temporary sibling renamed over it); a metrics line is one `write` in append mode.

A leaf: it imports nothing of the project.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".lock"
_HELD: dict[Path, list[int]] = {}
"""Directories this process holds: [descriptor, holders] (a lock is re-entrant here)."""


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    return p


def _probe(directory: Path, what: str, target: Path) -> None:
    """ValueError naming `what` unless a file can be created in `directory`."""
    if not directory.is_dir():
        raise ValueError(f"{what}={target}: {directory} is a file, not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".specroll-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{what}={target}: cannot write in {directory} ({e.strerror})") from e


def check_dir(path: str | Path, what: str = "--out") -> Path:
    """`path` as an output directory: not a file, and writable (or creatable)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what}={p} is a file; an output directory is needed")
    _probe(_nearest_existing(p), what, p)
    return p


def check_file(path: str | Path, what: str = "--out") -> Path:
    """`path` as an output file: not a directory, and its directory writable (or
    creatable)."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what}={p} is a directory; an output file is needed")
    _probe(_nearest_existing(p.parent), what, p)
    return p


class DirLock:
    """An exclusive lock on a directory while a command writes into it."""

    def __init__(self, directory: str | Path, what: str = "--out") -> None:
        self.dir, self.what = Path(directory), what
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        """Take the lock (making the directory); ValueError naming the holder if another
        process has it. Re-entrant within a process (nested holders share it)."""
        if self._fd is not None:
            return self
        key = self.dir.resolve()
        if key in _HELD:
            _HELD[key][1] += 1
            self._fd = _HELD[key][0]
            return self
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(f"{self.what}={self.dir} is in use: {holder(self.dir)}") from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(Path(sys.argv[0]).name.split() + sys.argv[1:]),
        }
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(info) + "\n").encode())
        self._fd = fd
        _HELD[key] = [fd, 1]
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        key = self.dir.resolve()
        held = _HELD.get(key)
        if held is not None:
            held[1] -= 1
            if held[1] == 0:
                del _HELD[key]
                os.close(self._fd)  # closing the descriptor drops the flock
        self._fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def holder(directory: str | Path) -> str:
    """Who holds `directory`'s lock, as its lock file says."""
    try:
        info = json.loads((Path(directory) / LOCK_FILE).read_text())
        return (
            f"held by pid {info['pid']} on {info['host']} since {info['since']} ({info['command']})"
        )
    except (OSError, ValueError, KeyError):
        return "held by another process"


def _umask() -> int:
    """This process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path`; renamed over it when the block ends without error
    (removed otherwise), so `path` holds the old file or the new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        # mkstemp makes the file private (0600); the result gets the mode any new file
        # gets (0644 under umask 022), so a server under another user can read an export
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    """Write `path` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def append_line(path: str | Path, line: str) -> None:
    """Append one line in one `write` (readers never see half of it unless the disk fills
    mid-write, which `read_lines` tolerates)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = (line.rstrip("\n") + "\n").encode()
        if os.write(fd, data) != len(data):
            raise OSError(f"{path}: short write (disk full?)")
    finally:
        os.close(fd)


def read_lines(path: str | Path) -> list[str]:
    """The complete lines of `path` (a last line without its newline was cut short by a
    crash or a full disk, and is left out)."""
    text = Path(path).read_text()
    lines = text.split("\n")
    return [x for x in lines[:-1] if x]


HF_DIR_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
"""What a Hugging Face model directory written by specroll holds (a run's policy/, an
export): the names a run or an export may replace in it, and nothing else."""
