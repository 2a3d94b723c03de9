"""Checkpoints of a training run: everything needed to continue exactly.

A checkpoint holds the policy and draft weights, both optimizers, the RNG states, the
step (which is also the data cursor: prompts and rollout seeds are functions of the
step) and the config. Beside the state, `meta.json` holds the step, the id of the run
that wrote it and its config, so a resume can be checked without loading any weights
(see `rundir`). It is written to a temporary directory and renamed, so a crash
mid-write never leaves a half checkpoint behind; only the newest `keep` are kept.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FORMAT = 2
"""The checkpoint layout written here (`meta.json`'s `format`); 1 = specroll before the
rl/ split, whose checkpoints carry no format (they do not resume: start over)."""


def _dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step-*") if p.is_dir() and (p / "state.pt").is_file())


def latest(root: str | Path) -> Path | None:
    """Newest complete checkpoint under `root`, or None."""
    found = _dirs(Path(root))
    return found[-1] if found else None


def save(
    root: str | Path,
    step: int,
    state: dict[str, Any],
    keep: int = 2,
    run_id: str = "",
    write: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint `step` (state: tensors/optimizer dicts/config) atomically.

    write: also writes into the checkpoint's directory (a sharded learner's DCP state)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    torch.save({**state, "step": step, "rng": rng}, tmp / "state.pt")
    if write is not None:
        write(tmp)
    meta = {"format": FORMAT, "step": step, "run_id": run_id, "config": state["config"]}
    (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in _dirs(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def meta(path: str | Path) -> dict[str, Any]:
    """The checkpoint's {format, step, run_id, config}, without loading its tensors."""
    f = Path(path) / "meta.json"
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: unreadable ({e})") from e


def load(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint and restore the global RNG states it saved."""
    state = torch.load(Path(path) / "state.pt", weights_only=False)
    state["path"] = str(path)  # where a sharded learner state lies (`learner/`)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state
