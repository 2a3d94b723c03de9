"""A run directory belongs to one run: who owns it, and whether a run may start there.

`specroll train --out X` writes metrics, config, report, plots, checkpoints and the
final policy and draft into X. Two runs sharing X would mix their files: a fresh run
would overwrite the old metrics, and `--resume` could pick up the *other* run's newest
checkpoint and replace the policy with its weights while the metrics describe this one.
So every run gets an id, written to `X/run.json` when it starts and into every
checkpoint it saves (`meta.json`, read without loading the weights):

* a fresh run refuses a directory that holds another run's work (metrics or
  checkpoints) unless told to overwrite it, which deletes that work first;
* `--resume` continues only from a checkpoint of the run that owns the directory,
  written with the same settings (placement and length may change), and says so when
  the run has already finished instead of redoing its end.

`check` reads only small JSON files, so the CLI calls it before loading any model.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from specroll.rl import checkpoint

RUN_FILE = "run.json"
OUTPUTS = (
    "metrics.jsonl",
    "config.json",
    "report.md",
    "reward.png",
    "acceptance.png",
    "stages.png",
    "checkpoints",
    "policy",
    "draft",
    "tb",
    RUN_FILE,
)
"""Everything a run writes into its directory (what --overwrite deletes)."""

FREE_TO_CHANGE = {
    ("pipeline", "steps"),
    ("rollout", "backend"),
    ("log", "tensorboard"),
    ("rollout", "device"),
    ("learner", "device"),
    ("learner", "strategy"),
    ("learner", "ranks"),
}
"""Settings a resumed run may change: they do not change what a step computes."""
FREE_SECTIONS = {"ray"}
"""Placement: a synchronous Ray run repeats the in-process one."""


@dataclass(frozen=True)
class Plan:
    """What `check` decided for a run directory."""

    action: str
    """'fresh' (start a new run), 'resume' (continue from `checkpoint`) or 'finished'."""
    checkpoint: Path | None = None
    """The checkpoint to resume from."""
    step: int = 0
    """Its step."""

    def finished_message(self, out: str | Path, steps: int) -> str:
        """What to tell a user who resumes a run that has already finished."""
        return (
            f"{out}: this run finished at step {self.step} (pipeline.steps={steps}); "
            "nothing to do. Raise --steps to continue it."
        )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from e


def holds_work(out: Path) -> bool:
    """Whether `out` holds another run's results (metrics or checkpoints)."""
    metrics = out / "metrics.jsonl"
    has_metrics = metrics.is_file() and metrics.stat().st_size > 0
    return has_metrics or checkpoint.latest(out / "checkpoints") is not None


def config_mismatch(mine: dict, theirs: dict) -> str | None:
    """The first setting (other than placement and length) that differs, as a message."""
    for sec, fields in mine.items():
        if sec in FREE_SECTIONS:
            continue
        for key, value in fields.items():
            if (sec, key) in FREE_TO_CHANGE:
                continue
            if key not in theirs.get(sec, {}) and value == _default(sec, key):
                continue  # a setting newer than the checkpoint, left at its default
            old = theirs.get(sec, {}).get(key)
            if _norm(value) != _norm(old):
                return (
                    f"the checkpoint was written with {sec}.{key}={old!r}, this run has "
                    f"{value!r}; resume with the same settings"
                )
    return None


def check(out: str | Path, config: dict, steps: int, resume: bool, overwrite: bool) -> Plan:
    """Decide what a run in `out` may do, before any work; ValueError if it may not.

    config: the run's `TrainConfig.to_dict()`; steps: its `pipeline.steps`.
    """
    out = Path(out)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite contradict each other: choose one")
    if not resume:
        if holds_work(out) and not overwrite:
            raise ValueError(
                f"{out} holds another run's metrics or checkpoints; continue it with "
                "--resume, start over with --overwrite (deletes them), or choose another --out"
            )
        return Plan("fresh")
    ck = checkpoint.latest(out / "checkpoints")
    if ck is None:
        raise ValueError(f"--resume: no checkpoint under {out / 'checkpoints'}")
    run_file = out / RUN_FILE
    if not run_file.is_file():
        raise ValueError(
            f"--resume: {out} has checkpoints but no {RUN_FILE} (written by another tool or "
            "an older specroll), so they cannot be shown to belong to this run; start over "
            "with --overwrite or choose another --out"
        )
    run_id = _read_json(run_file).get("run_id")
    meta = checkpoint.meta(ck)
    if meta.get("run_id") != run_id:
        raise ValueError(
            f"--resume: {ck} belongs to run {meta.get('run_id')!r}, not to run {run_id!r} "
            f"that owns {out}; refusing to load another run's weights"
        )
    problem = config_mismatch(config, meta.get("config", {}))
    if problem:
        raise ValueError(f"--resume: {problem} (from {ck})")
    step = int(meta["step"])
    if step >= steps:
        return Plan("finished", ck, step)
    return Plan("resume", ck, step)


def start(out: str | Path, config: dict, plan: Plan) -> str:
    """Claim `out` for a fresh run (deleting the old run's outputs) or reopen it for a
    resumed one; returns the run id that checkpoints are stamped with."""
    out = Path(out)
    if plan.action != "fresh":
        return _read_json(out / RUN_FILE)["run_id"]
    for name in OUTPUTS:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:12]
    (out / RUN_FILE).write_text(json.dumps({"run_id": run_id}) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return run_id


def _default(section: str, key: str):
    """The default of setting section.key (what a checkpoint that predates it ran with)."""
    import dataclasses

    from specroll.rl.config import SECTIONS

    for f in dataclasses.fields(SECTIONS[section]):
        if f.name == key:
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return f.default
    return dataclasses.MISSING


def _norm(v):
    return list(v) if isinstance(v, tuple) else v
