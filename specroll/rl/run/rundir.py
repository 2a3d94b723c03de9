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

`check` reads only small JSON files, so the CLI calls it before loading any model; a
`RunDir` then holds the directory for the run it planned: it claims or reopens it, keeps
`metrics.jsonl`, and turns Ctrl-C into a stop at the next stage boundary.
"""

from __future__ import annotations

import json
import shutil
import signal
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specroll.rl.run import checkpoint

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
    ("learner", "placement"),
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
    if meta.get("format") != checkpoint.FORMAT:
        raise ValueError(
            f"--resume: {ck} is in checkpoint format {meta.get('format', 1)}, this specroll "
            f"reads format {checkpoint.FORMAT} (README: Checkpoints); start over with "
            "--overwrite or choose another --out"
        )
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


def _norm(v):
    return list(v) if isinstance(v, tuple) else v


class RunDir:
    """A run's directory while it trains: claimed (fresh) or reopened (resume) from a
    checked `Plan`, its `metrics.jsonl`, and Ctrl-C: the first sets `stop_requested` (the
    trainer stops at the next stage boundary and saves), a second exits at once.

    Use as a context manager: the Ctrl-C handler is installed inside the block only."""

    def __init__(
        self, out: str | Path, config: dict, plan: Plan, log: Callable[[str], None] = print
    ) -> None:
        self.out, self.config, self.plan, self.log = Path(out), config, plan, log
        self.metrics = self.out / "metrics.jsonl"
        self.run_id = ""
        """The id of the run that owns the directory (stamped on every checkpoint)."""
        self.stop_requested = False
        self._previous = None

    def open(self, resumed_step: int = 0) -> None:
        """Claim the directory (fresh) or reopen it, keeping only the metrics of steps up
        to `resumed_step` (resume: lines past the checkpoint are redone)."""
        self.run_id = start(self.out, self.config, self.plan)
        if self.plan.action != "resume":
            self.metrics.write_text("")
            return
        lines = self.metrics.read_text().splitlines() if self.metrics.exists() else []
        kept = [x for x in lines if json.loads(x).get("step", 0) <= resumed_step]
        self.metrics.write_text("".join(x + "\n" for x in kept))

    def append(self, row: dict) -> None:
        """One line of metrics."""
        with open(self.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")

    def rows(self) -> list[dict]:
        """Every metrics line of the run so far."""
        return [json.loads(x) for x in self.metrics.read_text().splitlines()]

    def request_stop(self) -> None:
        """Stop at the next stage boundary (what the first Ctrl-C does)."""
        self.stop_requested = True

    def _on_sigint(self, signum, frame) -> None:
        if self.stop_requested:
            raise KeyboardInterrupt
        self.request_stop()
        self.log("Ctrl-C: finishing the current stage, then saving a checkpoint")

    def __enter__(self) -> RunDir:
        self._previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)
