"""What a run reads besides its settings, fingerprinted: its data files and reward code.

A resumed run repeats the uninterrupted one only if it reads the same data and scores
with the same reward functions. The config names them by path, and a path says nothing
of what is in the file now: a data file edited, regenerated or replaced, or a reward
module changed between two sessions, would silently turn the second half of a run into
another experiment. So a run records the SHA-256 of each in `run.json` when it starts
(`rundir.start`), and on `--resume` `check` compares them and names what changed: the
resume is refused unless the user says the change is intended (`ALLOW_CHANGED`).

What is fingerprinted: `data.train` and `data.val`, a file or
every file of a `save_to_disk` directory; and the source file of each user reward in
`reward.functions` (the file of 'path.py:fn', the module of 'pkg.mod:fn', found as
`tasks.reward_refs` finds it; a module it imports in turn is not followed). Hashing reads
each file once (`checkpoint.sha256`) at about 1.5 GiB/s on a 2-core Zen 5, so a 1 GB
data file costs about 0.6 s at start and at resume; a file already hashed in this
process (same size, modification time and inode) is not read again.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from specroll.rl.run import checkpoint
from specroll.tasks import reward_refs

ALLOW_CHANGED = "--allow-changed-inputs"
"""The flag that lets a resumed run read changed data files or reward code."""
SHOWN = 12
"""Hex digits of a digest shown in a message (enough to tell two apart)."""
_cache: dict[tuple, str] = {}
"""{(path, size, mtime_ns, inode): sha256} of the files hashed in this process."""


def digests(config: dict) -> dict[str, dict]:
    """{what: {path, sha256[, files]}} of the data files and user reward sources of a run
    (config: `TrainConfig.to_dict()`); a missing file has no entry (the settings' own
    checks name it)."""
    data, out = config.get("data", {}), {}
    task = data.get("task", "math")
    train = data.get("train") or ("" if task == "math" else task)
    for what, value in (("data.train", train), ("data.val", data.get("val", ""))):
        if value:
            entry = _entry(Path(value).expanduser())
            if entry:
                out[what] = entry
    for text in config.get("reward", {}).get("functions", ()):
        source = _reward_source(text)
        entry = _entry(source) if source else None
        if entry:
            out[f"reward {text}"] = entry
    return out


def changes(recorded: dict[str, dict], now: dict[str, dict]) -> list[str]:
    """What differs between the digests a run recorded and those of the files now, a
    phrase each ('data.train (d/train.jsonl): recorded sha256 1a2b..., now 9f8e...')."""
    out = []
    for what in sorted(set(recorded) | set(now)):
        old, new = recorded.get(what), now.get(what)
        if new is None:  # a setting names another file: the config check says which
            if isinstance(old, dict):
                out.append(f"{what} ({old.get('path')}) is gone")
            continue
        old = old if isinstance(old, dict) else {}  # not recorded, or run.json edited
        if old.get("sha256") == new["sha256"]:
            continue
        a, b = old.get("files") or {}, new.get("files") or {}
        inner = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        where = f", in {', '.join(inner[:3])}" + (" ..." if len(inner) > 3 else "") if inner else ""
        out.append(
            f"{what} ({new['path']}): recorded sha256 {str(old.get('sha256'))[:SHOWN]}, now "
            f"{new['sha256'][:SHOWN]}{where}"
        )
    return out


def check(
    recorded: dict | None, config: dict, allow_changed: bool, run_file: Path
) -> tuple[tuple[str, ...], dict | None]:
    """(notes, digests to record) for a resume, or a ValueError naming each data file or
    reward source whose content changed since the run began, unless that is allowed."""
    now = digests(config)
    if not isinstance(recorded, dict):
        note = (
            f"{run_file} records no digests of the data files and reward code (written by "
            "an older specroll): a change to them since the run began cannot be detected; "
            "they are recorded from now on"
        )
        return (note,), now
    changed = changes(recorded, now)
    if not changed:
        return (), None
    if not allow_changed:
        raise ValueError(
            f"--resume: the run's inputs changed since it began: {'; '.join(changed)}; "
            f"resume with the files as they were, or add {ALLOW_CHANGED} if the change "
            "is intended"
        )
    return (f"resuming with changed inputs ({ALLOW_CHANGED}): {'; '.join(changed)}",), now


def _reward_source(text: str) -> Path | None:
    """The source file of a user reward function (None: a built-in, or no source)."""
    try:
        ref = reward_refs.parse(text)
        return None if ref.builtin else reward_refs.source(ref)
    except ValueError:
        return None


def _entry(path: Path) -> dict | None:
    """{path, sha256} of a file, or of a directory: one digest over its files' names and
    digests, with {relative name: sha256} of each to say which one changed."""
    if path.is_file():
        return {"path": str(path), "sha256": _sha256(path)}
    if not path.is_dir():
        return None
    files = {str(f.relative_to(path)): _sha256(f) for f in sorted(path.rglob("*")) if f.is_file()}
    h = hashlib.sha256()
    for name, digest in files.items():
        h.update(f"{name}\0{digest}\n".encode())
    return {"path": str(path), "sha256": h.hexdigest(), "files": files}


def _sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _cache:
        _cache[key] = checkpoint.sha256(path)
    return _cache[key]
