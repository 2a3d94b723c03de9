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
  written with the same settings (placement and length may change) and the same data
  files and reward code (their SHA-256, recorded in `run.json`: `inputs`; a change is
  named, and allowed only when the user says it is intended), and says so when the run
  has already finished instead of redoing its end.

`check` reads only small JSON files (and, on a resume, hashes the data files and reward
sources: `inputs`), so the CLI calls it before loading any model; a `RunDir` then holds
the directory for the run it planned: it claims or reopens it, keeps `metrics.jsonl`, and
turns Ctrl-C into a stop at the next stage boundary.
"""

from __future__ import annotations

import json
import shutil
import signal
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specroll import outputs
from specroll.rl.errors import Stopped
from specroll.rl.run import checkpoint, inputs

RUN_FILE = "run.json"
OUTPUTS = (
    "metrics.jsonl",
    "samples.jsonl",
    "config.json",
    "report.md",
    "reward.png",
    "acceptance.png",
    "stages.png",
    "checkpoints",
    "policy",
    "draft",
    "tb",
    "wandb",
    "mlruns",
    "exports",
    RUN_FILE,
)
"""Everything a run writes into its directory (what --overwrite deletes)."""
WRITTEN_IN = {
    "checkpoints": ("step-*", ".tmp-step-*"),
    "policy": outputs.HF_DIR_FILES,
    "draft": ("config.json", "*.safetensors"),
    "tb": ("events.out.tfevents.*",),
    "wandb": ("offline-run-*", "run-*", "latest-run", "debug*.log"),
    "mlruns": ("[0-9]*", ".trash", "models"),  # MLflow's file store: experiments by id
    "exports": ("step-*", ".tmp-step-*", ".old-step-*"),
}
"""What a run writes inside its output directories; anything else there is the user's,
and --overwrite refuses to delete it."""

FREE_TO_CHANGE = {
    ("pipeline", "steps"),
    ("pipeline", "out_dir"),
    ("rollout", "backend"),
    ("log", "tensorboard"),
    ("log", "wandb"),
    ("log", "wandb_project"),
    ("log", "mlflow"),
    ("log", "mlflow_uri"),
    ("log", "mlflow_experiment"),
    ("log", "run_name"),
    ("log", "samples"),
    ("pipeline", "export_every"),
    ("pipeline", "export_dtype"),
    ("rollout", "device"),
    ("learner", "device"),
    ("learner", "strategy"),
    ("learner", "ranks"),
    ("learner", "placement"),
}
"""Settings a resumed run may change: they do not change what a step computes (the
directory may be moved, or named by another path)."""
FREE_SECTIONS = {"ray"}
"""Placement: a synchronous Ray run repeats the in-process one."""


@dataclass(frozen=True)
class Plan:
    """What `check` decided for a run directory."""

    action: str
    """'fresh' (start a new run), 'resume' (continue from `checkpoint`), 'finalize' (the
    run's steps are done but its end was not written: export and report) or 'finished'."""
    checkpoint: Path | None = None
    """The checkpoint to resume from."""
    step: int = 0
    """Its step."""
    planned: int = 0
    """The steps the run that wrote the checkpoint was set to run."""
    skipped: tuple[str, ...] = ()
    """Damaged newer checkpoints passed over, each with the reason."""
    notes: tuple[str, ...] = ()
    """Warnings for the user when the directory is opened (inputs that changed, allowed;
    a run too old to have recorded its inputs)."""
    inputs: dict | None = field(default=None, compare=False)
    """Digests of the inputs to record in run.json when the directory is reopened (None:
    keep what it holds): a change the user allowed, or a run that recorded none."""

    def finished_message(self, out: str | Path, steps: int) -> str:
        """What to tell a user who resumes a run that has nothing left to do."""
        if self.planned > self.step:  # stopped early; asked for fewer steps than it has
            return (
                f"{out}: this run has done {self.step} of its {self.planned} steps, not fewer "
                f"than --steps {steps}; nothing to do. Continue it with --steps "
                f"{self.planned} (or more)."
            )
        return (
            f"{out}: this run finished at step {self.step} (pipeline.steps={steps}); "
            "nothing to do. Raise --steps to continue it."
        )


def _read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})") from e
    if not isinstance(out, dict):
        raise ValueError(f"{path}: unreadable (not a JSON object)")
    return out


def holds_work(out: Path) -> bool:
    """Whether `out` holds another run's results (metrics or checkpoints)."""
    metrics = out / "metrics.jsonl"
    has_metrics = metrics.is_file() and metrics.stat().st_size > 0
    return has_metrics or checkpoint.latest(out / "checkpoints") is not None


def foreign_files(out: Path) -> list[Path]:
    """Files inside `out`'s output directories that a run does not write (the user's)."""
    found = []
    for name, patterns in WRITTEN_IN.items():
        d = out / name
        if d.is_dir():
            found += [p for p in sorted(d.iterdir()) if not any(p.match(x) for x in patterns)]
        elif d.exists():
            found.append(d)
    return found


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


def check(
    out: str | Path,
    config: dict,
    steps: int,
    resume: bool,
    overwrite: bool,
    allow_changed_inputs: bool = False,
) -> Plan:
    """Decide what a run in `out` may do, before any work; ValueError if it may not.

    config: the run's `TrainConfig.to_dict()`; steps: its `pipeline.steps`;
    allow_changed_inputs: a resume may read data files or reward code that changed since
    the run began (the user said so: `inputs.ALLOW_CHANGED`).
    """
    out = Path(out)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite contradict each other: choose one")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out={out} is a file; a run needs a directory")
    if not resume:
        return _check_fresh(out, overwrite)
    return _check_resume(out, config, steps, allow_changed_inputs)


def _check_fresh(out: Path, overwrite: bool) -> Plan:
    present = [n for n in OUTPUTS if (out / n).exists()]
    if not present:
        return Plan("fresh")
    if not overwrite:
        if holds_work(out):
            raise ValueError(
                f"{out} holds another run's metrics or checkpoints; continue it with "
                "--resume, start over with --overwrite (deletes them), or choose another --out"
            )
        if (out / RUN_FILE).is_file() and set(present) <= {
            RUN_FILE,
            "config.json",
            "metrics.jsonl",
            "samples.jsonl",
            "wandb",
            "mlruns",
        }:
            return Plan("fresh")  # a run that stopped before its first step: reclaimed
        shown = ", ".join(n + "/" if (out / n).is_dir() else n for n in present)
        raise ValueError(
            f"{out} holds {shown}, which a run writes; choose another --out, or add "
            "--overwrite to replace them"
        )
    foreign = foreign_files(out)
    if foreign:
        shown = ", ".join(str(p) for p in foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"--overwrite deletes only what a run writes, and {shown} is not: move it, or "
            "choose another --out"
        )
    return Plan("fresh")


def _check_resume(out: Path, config: dict, steps: int, allow_changed: bool) -> Plan:
    if checkpoint.latest(out / "checkpoints") is None:
        raise ValueError(f"--resume: no checkpoint under {out / 'checkpoints'}")
    ck, skipped = checkpoint.newest_intact(out / "checkpoints")
    if ck is None:
        raise ValueError(
            f"--resume: no intact checkpoint under {out / 'checkpoints'}: " + "; ".join(skipped)
        )
    run_file = out / RUN_FILE
    if not run_file.is_file():
        raise ValueError(
            f"--resume: {out} has checkpoints but no {RUN_FILE} (written by another tool or "
            "an older specroll), so they cannot be shown to belong to this run; start over "
            "with --overwrite or choose another --out"
        )
    run = _read_json(run_file)
    run_id = run.get("run_id")
    meta = checkpoint.meta(ck)
    if meta.get("format") != checkpoint.FORMAT:
        raise ValueError(
            f"--resume: {ck} is in checkpoint format {meta.get('format', 1)}, this specroll "
            f"reads format {checkpoint.FORMAT} (README: Checkpoints); start over with "
            "--overwrite or choose another --out"
        )
    if meta["run_id"] != run_id:
        raise ValueError(
            f"--resume: {ck} belongs to run {meta['run_id']!r}, not to run {run_id!r} "
            f"that owns {out}; refusing to load another run's weights"
        )
    problem = config_mismatch(config, meta["config"])
    if problem:
        raise ValueError(f"--resume: {problem} (from {ck})")
    step = int(meta["step"])
    planned = int(meta["config"].get("pipeline", {}).get("steps", step))
    if step < steps:
        action = "resume"
    elif step >= planned and not (out / "report.md").is_file():
        action = "finalize"  # stopped between its last checkpoint and its report
    else:
        return Plan("finished", ck, step, planned, tuple(skipped))
    notes, record = inputs.check(run.get("inputs"), config, allow_changed, run_file)
    return Plan(action, ck, step, planned, tuple(skipped), notes, record)


def start(out: str | Path, config: dict, plan: Plan) -> str:
    """Claim `out` for a fresh run (deleting the old run's outputs, which `check` showed to
    hold nothing but what a run writes) or reopen it; returns the run id that checkpoints
    are stamped with."""
    out = Path(out)
    if plan.action != "fresh":
        run = _read_json(out / RUN_FILE)
        if plan.inputs is not None:  # a change the user allowed: the new files' digests
            run["inputs"] = plan.inputs
            outputs.write_text(out / RUN_FILE, json.dumps(run) + "\n")
        return run["run_id"]
    for name in OUTPUTS:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex[:12]
    run = {"run_id": run_id, "inputs": inputs.digests(config)}
    outputs.write_text(out / RUN_FILE, json.dumps(run) + "\n")
    outputs.write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    return run_id


def _lines(path: Path) -> list[str]:
    return outputs.read_lines(path) if path.exists() else []


def _norm(v):
    return list(v) if isinstance(v, tuple) else v


SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
"""The signals a run stops on cleanly: the first finishes the stage and saves."""


class RunDir:
    """A run's directory while it trains: locked against other processes, claimed (fresh)
    or reopened (resume, finalize) from a checked `Plan`, its `metrics.jsonl` (one whole
    line per step) and `samples.jsonl`, and the stop signals: the first Ctrl-C or SIGTERM sets
    `stop_requested` (the trainer stops at the next stage boundary and saves), a second
    exits at once, saying so.

    Use as a context manager: the signal handlers are installed inside the block only."""

    def __init__(
        self, out: str | Path, config: dict, plan: Plan, log: Callable[[str], None] = print
    ) -> None:
        self.out, self.config, self.plan, self.log = Path(out), config, plan, log
        self.metrics = self.out / "metrics.jsonl"
        self.samples = self.out / "samples.jsonl"
        self.run_id = ""
        """The id of the run that owns the directory (stamped on every checkpoint)."""
        self.stop_requested = False
        self.signum = signal.SIGINT
        """The signal that asked to stop."""
        self.settle: Callable[[], None] = lambda: None
        """Waits for a background checkpoint write (which exit would wait for anyway)."""
        self.lock = outputs.DirLock(self.out)
        self._previous: dict = {}

    def open(self, resumed_step: int = 0) -> None:
        """Lock and claim the directory (fresh) or reopen it, keeping only the metrics and
        samples of steps up to `resumed_step` (resume: lines past the checkpoint are redone)."""
        self.lock.acquire()
        self.run_id = start(self.out, self.config, self.plan)
        for note in self.plan.notes:
            self.log(f"warning: {note}")
        if self.plan.action == "fresh":
            outputs.write_text(self.metrics, "")
        elif self.plan.action == "resume":
            for path in (self.metrics, self.samples):
                if path.exists():
                    keep = [x for x in _lines(path) if json.loads(x).get("step", 0) <= resumed_step]
                    outputs.write_text(path, "".join(x + "\n" for x in keep))

    def close(self) -> None:
        self.lock.release()

    def _lines(self) -> list[str]:
        return _lines(self.metrics)

    def append(self, row: dict) -> None:
        """One line of metrics."""
        outputs.append_line(self.metrics, json.dumps(row))

    def append_samples(self, rows: list[dict]) -> None:
        """A step's sample completions, a line each (`samples.rows`)."""
        for row in rows:
            outputs.append_line(self.samples, json.dumps(row, ensure_ascii=False))

    def rows(self) -> list[dict]:
        """Every metrics line of the run so far."""
        return [json.loads(x) for x in self._lines()]

    def request_stop(self, signum: int = signal.SIGINT) -> None:
        """Stop at the next stage boundary (what the first Ctrl-C or SIGTERM does)."""
        self.stop_requested, self.signum = True, signum

    def _on_signal(self, signum, frame) -> None:
        name = SIGNALS[signum]
        if self.stop_requested:
            self.settle()
            newest = checkpoint.latest(self.out / "checkpoints")
            raise Stopped(
                signum,
                f"second {name}: stopped at once, without a checkpoint"
                + (f" (the newest is {newest.name})" if newest else ""),
            )
        self.request_stop(signum)
        self.log(f"{name}: finishing the current stage, then saving a checkpoint")

    def __enter__(self) -> RunDir:
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
