"""Soak of hostile use (issues 30 and 44): random runs of `specroll train --preset tiny`
(and of `export` and `generate` on its output).

Each case draws one kind of trouble, with random valid settings underneath. Issue 30's
five (`--areas run`):

  valid    a run to its end
  invalid  one setting out of bounds, non-finite, mistyped or unknown: refused in one line
  signal   SIGINT or SIGTERM at a random moment (start-up, a step, a save, the end), then
           `--resume`: the finished metrics must equal an uninterrupted run's
  damage   the newest checkpoint truncated, emptied, corrupted or stripped of its meta,
           then `--resume` for more steps: the previous good checkpoint takes over and
           the metrics equal an uninterrupted run's
  foreign  files of the user's in the output directory: a fresh run must refuse them

and issue 44's nine, files and values from elsewhere (`--areas inputs`, listed in
`soak_inputs.py`): rewards, data files, YAML, untrusted checkpoints, changed inputs on
resume, export, a full disk, generate and loggers; and issue 58's five (`--areas foreign`,
listed in `soak_foreign.py`): sizes a config implies, FIFOs in place of files, non-finite
values, large data files, cost profiles. `--areas all` draws from every one.

Every case also keeps a directory of user files next to the run's; all of them must be
byte-identical afterwards. Counted: tracebacks (target 0), runs that lost a completed
step (a logged step missing or changed after the resume, against the uninterrupted
reference; target 0), user files touched (target 0), code executions from files that
must be data (target 0), processes left behind (target 0), unexpected exit codes, hangs,
and each case's peak resident memory (the largest of its processes, from wait4).

    python benchmarks/soak_hostile.py --cases 50 --seed 0
    python benchmarks/soak_hostile.py --cases 50 --seed 0 --areas inputs

The last line is a JSON object with the counts and the configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from soak_foreign import FOREIGN_KINDS, ForeignCases  # a sibling script: issue 58's cases
from soak_inputs import INPUT_KINDS, InputCases  # a sibling script: issue 44's cases

KINDS = ("valid", "invalid", "signal", "damage", "foreign")
AREAS = {
    "run": KINDS,
    "inputs": INPUT_KINDS,
    "foreign": FOREIGN_KINDS,
    "all": KINDS + INPUT_KINDS + FOREIGN_KINDS,
}
VALID = {  # setting: values drawn from (all within bounds)
    "rollout.k": [1, 3, 5],
    "rollout.max_new_tokens": [8, 24, 40],
    "rollout.speculative": ["true", "false"],
    "data.group_size": [2, 4],
    "data.prompts_per_step": [2, 4],
    "pipeline.checkpoint_every": [1, 2, 3],
    # slots are min(max_batch, requests): a huge value sizes nothing
    "rollout.max_batch": [1, 4, 100000000],
    "loss.drop_uniform_groups": ["true", "false"],
}
INVALID = [  # (setting, exit code the run must end with)
    ("rollout.k=100000000", 2),
    ("rollout.max_new_tokens=100000000", 2),
    ("rollout.max_new_tokens=100000", 2),
    ("policy.micro_batch=0", 2),
    ("policy.lr=inf", 2),
    ("policy.lr=nan", 2),
    ("policy.lr=1e30", 1),  # finite, but the update is not: the learner's guard stops it
    ("rollout.temperature=-1", 2),
    ("rollout.k=-1", 2),
    ("rollout.k=three", 2),
    ("data.group_size=0", 2),
    ("data.train=/nonexistent/problems.jsonl", 2),
    ("learner.ranks=100000", 2),
    ("rollout.depth=bogus", 2),
    ("no_such.section=1", 2),
    ("pipeline.steps=-4", 2),
]
DAMAGE = ("truncate", "empty", "garbage", "no_meta", "empty_meta", "tmp_left")
TIMEOUT_S = 300
TAG = "SPECROLL_SOAK_CASE"
"""Environment variable naming the case in every process it starts: what still carries it
after a command ended was left behind (an orphaned reward worker)."""
SQUEEZE_BYTES = 64 << 10
"""The file-size limit a `disk` case puts on a running training: below a checkpoint."""
NON_TIMING = ("time", "step_s", "gen_tok_s", "gen_busy_s", "exposed_gen_s", "elapsed")


@dataclass
class Outcome:
    kind: str
    detail: str
    exits: list[int] = field(default_factory=list)
    peak_rss_mb: float = 0.0
    tracebacks: int = 0
    lost_steps: int = 0
    touched: int = 0
    unexpected: list[str] = field(default_factory=list)
    hangs: int = 0
    executed: int = 0
    orphans: int = 0


class Soak(InputCases, ForeignCases):
    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env = root, env
        self.references: dict[tuple, list[dict]] = {}
        self.tag = ""
        self._finished: Path | None = None

    # ---------------------------------------------------------------- processes

    def command(
        self,
        args: list[str],
        o: Outcome,
        file_size: int | None = None,
        signal_after: tuple[float, int] | None = None,
        squeeze_after_checkpoint: int | None = None,
        memory: int | None = None,
    ) -> tuple[int, str]:
        """Run `specroll ARGS`; returns (exit code, its output). Optional trouble: a file-
        size limit from the start (`file_size` bytes, as `ulimit -f`), a signal `(delay,
        signum)` seconds in, the file-size limit lowered to SQUEEZE_BYTES once checkpoint
        `squeeze_after_checkpoint` exists (a disk that fills mid-run), an address-space
        limit (`memory` bytes: a safety net where a case asks for more than the machine)."""
        cmd = [sys.executable, "-m", "specroll.cli", *args]

        def limits() -> None:
            import resource

            if file_size is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
            if memory is not None:
                resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

        env = {**self.env, TAG: self.tag}
        # a pipe, not a file: a file-size limit on the command must not swallow its output
        p = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=limits
        )
        chunks: list[bytes] = []
        reader = threading.Thread(target=lambda: chunks.extend(iter(p.stdout.readline, b"")))
        reader.daemon = True  # a process left behind may hold the pipe open
        reader.start()
        t0 = time.monotonic()
        done = None
        if signal_after is not None:
            delay, signum = signal_after
            while time.monotonic() - t0 < delay and done is None:
                done = _reap(p)
                time.sleep(0.02)
            if done is None:
                p.send_signal(signum)
        if squeeze_after_checkpoint is not None:
            done = _squeeze(p, args, squeeze_after_checkpoint, t0)
        rc, rss = done or _wait(p, t0)
        reader.join(timeout=5)
        if not reader.is_alive():
            p.stdout.close()
        text = b"".join(chunks).decode(errors="replace")
        if rc is None:
            o.hangs += 1
            rc = -9
        o.exits.append(rc)
        o.peak_rss_mb = max(o.peak_rss_mb, rss / 1024)
        o.orphans += _orphans(self.tag)
        if _traceback(text):
            o.tracebacks += 1
            o.unexpected.append(f"traceback in {' '.join(args)}: {text[-400:]}")
        return rc, text

    def train(self, out: Path, args: list[str], o: Outcome, **trouble) -> tuple[int, str]:
        """Run `specroll train --preset tiny --out OUT ARGS` (trouble: see `command`)."""
        return self.command(["train", "--preset", "tiny", "--out", str(out), *args], o, **trouble)

    def outcome(self, kind: str, detail: str) -> Outcome:
        return Outcome(kind, detail)

    def mark(self, case: Path) -> Path:
        """The file every payload of this case would create."""
        return case / "EXECUTED"

    def expect(self, o: Outcome, rc: int, text: str, allowed: tuple[int, ...]) -> None:
        """The exit code must be one of `allowed`; a refusal (1 or 2) ends with one line
        that starts 'error:' (a user's own traceback, indented, may follow it)."""
        last = _last_line(text)
        if rc not in allowed:
            o.unexpected.append(f"exit {rc} (want {allowed}), last line {last[:300]!r}")
        elif rc in (1, 2) and not last.startswith("error:"):
            o.unexpected.append(f"exit {rc} without a one-line error: {last[:300]!r}")

    def finished(self) -> Path:
        """A finished 2-step run with a checkpoint at each step (made once, then copied)."""
        if self._finished is None:
            out = self.root / "finished"
            o = Outcome("finished", "")
            args = ["--steps", "2", "--set", "pipeline.checkpoint_every=1"]
            rc, text = self.train(out, args, o)
            if rc != 0 or o.tracebacks:
                raise RuntimeError(f"the finished run failed ({rc}): {text[-800:]}")
            self._finished = out
        return self._finished

    def reference(self, settings: list[str], steps: int) -> list[dict]:
        """The uninterrupted run's metrics (non-timing keys) for these settings."""
        key = (tuple(settings), steps)
        if key not in self.references:
            out = self.root / f"ref-{len(self.references)}"
            o = Outcome("reference", "")
            rc, text = self.train(out, ["--steps", str(steps), *_sets(settings)], o)
            if rc != 0 or o.tracebacks:
                raise RuntimeError(f"reference run failed ({rc}): {text[-800:]}")
            self.references[key] = metrics(out)
            shutil.rmtree(out)
        return self.references[key]

    # ---------------------------------------------------------------- cases

    def case(self, i: int, kind: str, rng: random.Random) -> Outcome:
        work = self.root / f"case-{i:03d}"
        self.tag = str(work)
        user = work / "user"
        user.mkdir(parents=True)
        for name in ("notes.txt", "data.jsonl"):
            (user / name).write_text(f"the user's {name} {rng.random()}\n")
        before = _hashes(user)
        out = work / "run"
        settings = [f"{k}={rng.choice(v)}" for k, v in VALID.items() if rng.random() < 0.5]
        settings.append("rollout.depth=fixed")
        o = getattr(self, kind)(work, out, settings, rng)
        o.touched += sum(_hashes(user).get(k) != v for k, v in before.items())
        o.executed += self.mark(work).exists()
        shutil.rmtree(work)
        return o

    def valid(self, case: Path, out: Path, settings: list[str], rng: random.Random) -> Outcome:
        steps = rng.randint(2, 5)
        o = Outcome("valid", " ".join(settings))
        rc, text = self.train(out, ["--steps", str(steps), *_sets(settings)], o)
        got = _steps(out)
        if rc != 0 or got != list(range(1, steps + 1)):
            o.unexpected.append(f"exit {rc}, steps {got} of {steps}: {text[-300:]}")
        return o

    def invalid(self, case: Path, out: Path, settings: list[str], rng: random.Random) -> Outcome:
        bad, want = rng.choice(INVALID)
        o = Outcome("invalid", bad)
        rc, text = self.train(out, ["--steps", "3", *_sets([*settings, bad])], o)
        last = _last_line(text)
        if rc != want or not last.startswith("error:"):
            o.unexpected.append(f"{bad}: exit {rc} (want {want}), last line {last!r}")
        return o

    def signal(self, case: Path, out: Path, settings: list[str], rng: random.Random) -> Outcome:
        steps = rng.randint(6, 10)
        signum = rng.choice([signal.SIGINT, signal.SIGTERM])
        delay = rng.uniform(0.5, 12.0)
        o = Outcome("signal", f"{signal.Signals(signum).name} at {delay:.1f}s, {steps} steps")
        args = ["--steps", str(steps), *_sets(settings)]
        rc, text = self.train(out, args, o, signal_after=(delay, signum))
        # a signal that lands after the run's end (its "done:" line) ends the process
        # by the default handler: -signum, with every step and output already written
        ended = rc == -signum and "\ndone: " in text
        if rc not in (0, 128 + signum) and not ended:
            o.unexpected.append(f"exit {rc} after {o.detail}: {text[-300:]}")
        logged = metrics(out) if (out / "metrics.jsonl").exists() else []
        if rc != 0 and not ended:
            if (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
                rc2, text2 = self.train(out, ["--resume", *args], o)
            else:  # stopped before its first step: nothing to resume, start again
                rc2, text2 = self.train(out, ["--overwrite", *args], o)
            if rc2 != 0:
                o.unexpected.append(f"resume exit {rc2}: {text2[-300:]}")
        o.lost_steps += self.compare(out, settings, steps, logged, o)
        return o

    def damage(self, case: Path, out: Path, settings: list[str], rng: random.Random) -> Outcome:
        steps = rng.randint(2, 4)
        how = rng.choice(DAMAGE)
        o = Outcome("damage", f"{how} after {steps} steps")
        settings = [s for s in settings if not s.startswith("pipeline.checkpoint_every")]
        settings.append("pipeline.checkpoint_every=1")
        rc, text = self.train(out, ["--steps", str(steps), *_sets(settings)], o)
        if rc != 0 or _steps(out) != list(range(1, steps + 1)):
            o.unexpected.append(f"first run: exit {rc}, steps {_steps(out)}: {text[-300:]}")
            return o
        logged = metrics(out)
        newest = sorted((out / "checkpoints").iterdir())[-1]
        _damage(newest, how, rng)
        more = steps + 2
        rc2, text = self.train(out, ["--resume", "--steps", str(more), *_sets(settings)], o)
        if rc != 0 or rc2 != 0:
            o.unexpected.append(f"exits {rc}, {rc2}: {text[-300:]}")
        if how != "tmp_left" and "skipped the damaged checkpoint" not in text:
            o.unexpected.append(f"{how}: no word of the skipped checkpoint")
        # the damaged step is recomputed: what the first run logged up to it must stand
        # a run validates at its end: the first run's last row may hold a val_accuracy
        # the longer run's row of that step has not (not a change to a completed step)
        o.lost_steps += self.compare(out, settings, more, logged, o, loose_last=True)
        return o

    def foreign(self, case: Path, out: Path, settings: list[str], rng: random.Random) -> Outcome:
        o = Outcome("foreign", "")
        place = rng.choice(["notes.txt", "policy/notes.txt", "report.md", "metrics.jsonl"])
        o.detail = place
        (out / place).parent.mkdir(parents=True, exist_ok=True)
        (out / place).write_text("the user's own file\n")
        before = _hashes(out)
        rc, text = self.train(out, ["--steps", "2", *_sets(settings)], o)
        o.touched += sum(_hashes(out).get(k) != v for k, v in before.items())
        # a file of a name the run writes (or inside a directory it owns) must be refused;
        # any other may stay beside the run, untouched (counted above)
        if place == "notes.txt":
            if rc != 0:
                o.unexpected.append(f"{place}: exit {rc}, {text[-300:]}")
        elif rc != 2 or "error:" not in text:
            o.unexpected.append(f"{place}: exit {rc}, {text[-300:]}")
        return o

    def compare(
        self,
        out: Path,
        settings: list[str],
        steps: int,
        logged: list[dict],
        o: Outcome,
        loose_last: bool = False,
    ) -> int:
        """Steps lost: logged before the trouble, missing or different in the run's final
        metrics; those must also equal the uninterrupted run's."""
        ref = self.reference(settings, steps)
        final = metrics(out) if (out / "metrics.jsonl").exists() else []
        lost = sum(m not in final for m in (logged[:-1] if loose_last else logged))
        if loose_last and logged:
            lost += _no_val(logged[-1]) not in [_no_val(m) for m in final]
        if final != ref:
            o.unexpected.append(
                f"final metrics differ from the uninterrupted run: {_diff(final, ref)}"
            )
        return lost


# -------------------------------------------------------------------- helpers


def _sets(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


def _no_val(m: dict) -> dict:
    return {k: v for k, v in m.items() if k != "val_accuracy"}


def _steps(out: Path) -> list[int]:
    """The RL steps a run logged (step 0 is the validation before training)."""
    if not (out / "metrics.jsonl").exists():
        return []
    return sorted({m["step"] for m in metrics(out) if m["step"] > 0})


def _diff(got: list[dict], want: list[dict]) -> str:
    """The first row where two metric logs part, and the keys that differ there."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            return (
                f"row {i} (step {a.get('step')}): "
                + ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in keys)[:600]
            )
    return f"{len(got)} rows vs {len(want)}"


def _reap(p: subprocess.Popen) -> tuple[int, int] | None:
    """(exit code, peak RSS in KiB) of a child that has ended, else None (never through
    Popen.poll, which would reap it and lose its resource usage)."""
    pid, status, usage = os.wait4(p.pid, os.WNOHANG)
    if not pid:
        return None
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, usage.ru_maxrss


def _wait(p: subprocess.Popen, t0: float) -> tuple[int | None, int]:
    """Exit code (None after TIMEOUT_S: killed) and peak RSS in KiB of one child."""
    while time.monotonic() - t0 < TIMEOUT_S:
        done = _reap(p)
        if done:
            return done
        time.sleep(0.05)
    p.kill()
    _, _, usage = os.wait4(p.pid, 0)
    return None, usage.ru_maxrss


def metrics(out: Path) -> list[dict]:
    """metrics.jsonl without its timing keys (wall time differs between runs)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if k not in NON_TIMING} for m in rows]


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _damage(ckpt: Path, how: str, rng: random.Random) -> None:
    state, meta = ckpt / "state.pt", ckpt / "meta.json"
    if how == "truncate":
        data = state.read_bytes()
        state.write_bytes(data[: rng.randint(0, len(data) - 1)])
    elif how == "empty":
        state.write_bytes(b"")
    elif how == "garbage":
        data = bytearray(state.read_bytes())
        at = rng.randint(0, len(data) - 64)
        data[at : at + 64] = bytes(rng.randrange(256) for _ in range(64))
        state.write_bytes(bytes(data))
    elif how == "no_meta":
        meta.unlink()
    elif how == "empty_meta":
        meta.write_text("")
    elif how == "tmp_left":  # a save cut short by a full disk leaves its staging dir
        tmp = ckpt.parent / f".tmp-{ckpt.name}-x"
        shutil.copytree(ckpt, tmp)
        (tmp / "state.pt").write_bytes(b"\0" * 10)


def _traceback(text: str) -> bool:
    """Whether specroll's output holds a traceback of its own (a reward function's, shown
    indented under the error that names it, is the user's and expected)."""
    return any(line.startswith("Traceback (most recent call last)") for line in text.splitlines())


def _last_line(text: str) -> str:
    """The last line of the output that is not indented (the user's traceback below an
    error line is)."""
    lines = [line for line in text.strip().splitlines() if line and not line[0].isspace()]
    return lines[-1] if lines else ""


def _orphans(tag: str, grace_s: float = 3.0) -> int:
    """Processes still carrying the case's TAG `grace_s` after its command ended (each is
    killed once counted)."""

    def alive() -> list[int]:
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"{TAG}={tag}".encode() in env:
                pids.append(int(d.name))
        return pids

    t0 = time.monotonic()
    while (pids := alive()) and time.monotonic() - t0 < grace_s:
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(OSError):  # ended in the meantime
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def _squeeze(p: subprocess.Popen, args: list[str], step: int, t0: float):
    """Lower the file-size limit of a running training to SQUEEZE_BYTES once its
    checkpoint `step` exists; (exit code, RSS) if it ended first, else None."""
    import resource

    out = Path(args[args.index("--out") + 1])
    want = out / "checkpoints" / f"step-{step:06d}"
    while time.monotonic() - t0 < TIMEOUT_S:
        done = _reap(p)
        if done:
            return done
        if want.is_dir():
            resource.prlimit(p.pid, resource.RLIMIT_FSIZE, (SQUEEZE_BYTES, SQUEEZE_BYTES))
            return None
        time.sleep(0.05)
    return None


def run(cases: int, seed: int, root: Path, areas: str = "run") -> dict:
    env = {**os.environ, "SPECROLL_HOME": str(root / "home"), "PYTHONUNBUFFERED": "1"}
    soak = Soak(root, env)
    rng = random.Random(seed)
    outcomes = []
    kinds = AREAS[areas]
    for i in range(cases):
        kind = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        t = time.monotonic()
        o = soak.case(i, kind, random.Random(rng.random()))
        outcomes.append(o)
        bad = o.unexpected or o.tracebacks or o.lost_steps or o.touched or o.executed or o.orphans
        flag = "!!" if bad else "ok"
        print(
            f"[{i + 1}/{cases}] {flag} {o.kind:8s} {o.detail[:60]:60s} exits {o.exits} "
            f"rss {o.peak_rss_mb:.0f} MB  {time.monotonic() - t:.0f}s",
            file=sys.stderr,
            flush=True,
        )
        for u in o.unexpected:
            print(f"    {u}", file=sys.stderr)
    rss = [o.peak_rss_mb for o in outcomes]
    return {
        "cases": cases,
        "by_kind": {k: sum(o.kind == k for o in outcomes) for k in kinds},
        "tracebacks": sum(o.tracebacks for o in outcomes),
        "lost_completed_steps": sum(o.lost_steps for o in outcomes),
        "user_files_touched": sum(o.touched for o in outcomes),
        "code_executions": sum(o.executed for o in outcomes),
        "orphans": sum(o.orphans for o in outcomes),
        "unexpected": sum(bool(o.unexpected) for o in outcomes),
        "hangs": sum(o.hangs for o in outcomes),
        "peak_rss_mb": {
            "median": round(statistics.median(rss), 1),
            "max": round(max(rss), 1),
            "each": [round(r) for r in rss],
        },
        "config": {"seed": seed, "areas": areas, "preset": "tiny", "timeout_s": TIMEOUT_S},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--areas",
        choices=sorted(AREAS),
        default="run",
        help="run: issue 30's kinds (signals, damage, settings, foreign files); inputs: "
        "issue 44's (files and values from elsewhere); foreign: issue 58's (sizes, FIFOs, "
        "non-finite values, large data, profiles); all: every kind",
    )
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="specroll-soak-"))
    try:
        print(json.dumps(run(args.cases, args.seed, root, args.areas)))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
