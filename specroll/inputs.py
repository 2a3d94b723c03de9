"""Files from elsewhere (models, drafts, adapters, profiles, configs), read only as data.

Three rules every loader of such a file follows, here once:

* **A regular file, checked before it is opened.** A FIFO in place of a weights file
  would block the reader forever, and in native code (safetensors, tokenizers) no
  signal handler gets to run: Ctrl-C and SIGTERM would not stop the command. A device
  file would read without end. So every file, and every plain entry of a directory that
  a native library will scan, must be a regular file (a symlink to one is fine: that is
  how the Hugging Face cache lays out snapshots).
* **JSON of a bounded size**, decoded as UTF-8, its failure one line naming the file.
* **Finite weights.** A NaN or infinity in a draft, a policy or an adapter ends a run
  at its first step with a NaN loss that names nothing; it is refused at load, naming
  the file and the tensor.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

JSON_LIMIT = 64 << 20
"""Bytes a JSON file from elsewhere may hold (configs, profiles, metadata): the largest
real ones (a tokenizer's config with its chat template) are well under 1 MiB."""
ENTRIES_LIMIT = 100_000
"""Entries a model or draft directory may hold before it is refused unlisted."""


class UnreadableFile(ValueError):
    """A file from elsewhere that specroll will not (or cannot) read: the message is one
    line naming the file. A ValueError, so the commands report it as a bad input
    (`error: ...`, exit status 2)."""


def regular(path: str | Path, what: str = "file") -> Path:
    """`path`, when it is a regular file (after symlinks); UnreadableFile naming it and
    `what` it should be otherwise (missing, a FIFO, a device, a directory)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UnreadableFile(f"{path}: missing") from None
    except OSError as e:
        raise UnreadableFile(f"{path}: {what} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = "FIFO" if stat.S_ISFIFO(mode) else "directory" if stat.S_ISDIR(mode) else "device"
        if stat.S_ISSOCK(mode):
            kind = "socket"
        raise UnreadableFile(f"{path}: not a regular file (this {what} is a {kind}); not read")
    return path


def regular_entries(directory: str | Path, what: str) -> Path:
    """`directory` when every entry in it that is not a directory is a regular file
    (what a tokenizer or a weights scan may open) and no JSON file in it is larger than
    JSON_LIMIT; UnreadableFile naming the first that is not. A missing directory is the
    caller's to report."""
    directory = Path(directory)
    with os.scandir(directory) as it:
        for n, entry in enumerate(it):
            if n >= ENTRIES_LIMIT:
                raise UnreadableFile(f"{directory}: more than {ENTRIES_LIMIT} entries")
            if not entry.is_dir():
                regular(entry.path, f"{what}'s file")
                # a native JSON parser (tokenizers) holds signals off while it reads
                size = entry.stat().st_size
                if entry.name.endswith(".json") and size > JSON_LIMIT:
                    raise UnreadableFile(
                        f"{entry.path}: a JSON file of {size} bytes, more than {JSON_LIMIT}"
                    )
    return directory


def read_json(path: str | Path, what: str, limit: int = JSON_LIMIT) -> Any:
    """The JSON value in `path` (a `what`: "draft config", ...): a regular file of at
    most `limit` bytes, UTF-8; any failure is one UnreadableFile line naming the file."""
    path = regular(path, what)
    size = path.stat().st_size
    if size > limit:
        raise UnreadableFile(f"{path}: the {what} holds {size} bytes, more than {limit}")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UnreadableFile(f"{path}: the {what} is not UTF-8 ({e.reason})") from None
    except (json.JSONDecodeError, RecursionError) as e:
        reason = str(e) if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        raise UnreadableFile(f"{path}: the {what} is not valid JSON ({reason})") from None
    except OSError as e:
        raise UnreadableFile(f"{path}: the {what} cannot be read ({e.strerror})") from None


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]], where: str | Path) -> None:
    """UnreadableFile naming `where` and the first tensor holding a NaN or an infinity
    (integer tensors pass: they cannot)."""
    import torch  # here: this module is a leaf that the simulator's side may import

    for name, t in tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise UnreadableFile(
                f"{where}: tensor {name!r} holds {bad} non-finite value(s) (NaN or infinity); "
                "weights must be finite"
            )


def shown(value: object, limit: int = 40) -> str:
    """repr(value) for an error message: cut to about `limit` characters (a 400-digit
    number says its length instead), control characters escaped (a NUL in a key from a
    file is never written raw to a terminal)."""
    text = repr(value)  # a str's repr escapes what is not printable
    return text if len(text) <= limit else f"{text[: limit // 2]}... ({len(text)} characters)"


def printable(text: object, limit: int = 80) -> str:
    """str(text) for an error message, as it is when printable; otherwise escaped like a
    repr (a NUL or a terminal escape from a file never reaches the terminal raw), and cut
    to about `limit` characters."""
    text = str(text)
    if not text.isprintable():
        text = repr(text)[1:-1]
    return text if len(text) <= limit else f"{text[: limit // 2]}... ({len(text)} characters)"
