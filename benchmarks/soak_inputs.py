"""The soak's cases of files and values from elsewhere (issue 44), beside issue 30's
(`soak_hostile.py` runs both). Each case draws one area and one kind of trouble in it:

  reward     a user reward file that raises, hangs (at import or per call), returns a
             huge or non-finite value or 20,000 components, starts a non-daemon thread,
             asks for 64 GiB, or is hit by SIGINT/SIGTERM while it runs
  data       a training file with U+2028/U+0085 inside strings, a JSON array, UTF-16,
             600 levels of nesting, chat control tokens in the text, an unknown role,
             a FIFO, random bytes, nothing
  yaml       a --config alias bomb or !!python tag, a --set value that is not YAML or
             reads as a YAML 1.1 number, a size or seed far out of range
  untrusted  a checkpoint whose state.pt, or whose sharded learner/.metadata, carries a
             pickle payload, loaded by `export` and by `train --resume`
  changed    the data file or the reward code edited, then `--resume`: refused, naming
             the file, and taken with --allow-changed-inputs
  export     an export into a file-size limit (`ulimit -f`), into the user's directory,
             or an ordinary one
  disk       the file-size limit lowered under a running training (its next checkpoint
             cannot be written), then `--resume` without it
  generate   `generate --out` onto an existing file or its own --prompts, extreme
             temperatures and seeds
  logger     MLflow on (a file store in the run), sample rows, a signal, then `--resume`

Counted besides issue 30's figures: code executions (every payload would create the
case's marker file) and orphans (processes carrying the case's tag in their environment
after its command ended: a reward worker left behind).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import time
from pathlib import Path

INPUT_KINDS = (
    "reward",
    "data",
    "yaml",
    "untrusted",
    "changed",
    "export",
    "disk",
    "generate",
    "logger",
)

FAIL = (1, 2)
"""Exit codes of a run the reward stage stops (a RewardError is reported as exit 2)."""
REWARDS = {  # family: (module text, reward.timeout_s, exit codes allowed)
    "ok": ("def f(p, c, r):\n    return {'len': len(c) % 3 / 2, 'one': 1.0}\n", 30, (0,)),
    "raise": ("def f(p, c, r):\n    raise ValueError('no answer in ' + repr(r))\n", 30, FAIL),
    "hang": ("import time\n\ndef f(p, c, r):\n    time.sleep(1e6)\n", 2, FAIL),
    "huge_int": ("def f(p, c, r):\n    return 10**400\n", 30, FAIL),
    "huge_float": ("def f(p, c, r):\n    return 1e308\n", 30, FAIL),
    "inf": ("def f(p, c, r):\n    return float('inf')\n", 30, FAIL),
    "components": ("def f(p, c, r):\n    return {f'k{i}': 0.0 for i in range(20000)}\n", 30, FAIL),
    "text_names": ("def f(p, c, r):\n    return {c[:40] or 'x': 1.0}\n", 30, (0, *FAIL)),
    "thread": (
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(1e6,)).start()\n\n"
        "def f(p, c, r):\n    return 0.5\n",
        30,
        (0,),
    ),
    "import_hang": ("import time\ntime.sleep(1e6)\n\ndef f(p, c, r):\n    return 0.0\n", 2, (1, 2)),
    "memory": ("def f(p, c, r):\n    return float(len(bytearray(1 << 36)))\n", 30, FAIL),
    "signal": ("import time\n\ndef f(p, c, r):\n    time.sleep(1e6)\n", 120, ()),
}

SAFETY_NET = 16 << 30
"""Address-space limit of a run whose reward asks for 64 GiB: if the worker's own bound
failed, the allocation fails here rather than on the machine."""

RECORDS = 40
"""Records of a data case's file: a tiny run's 4 prompts a step and 8 held out."""


def _records(rng: random.Random, text: str = "") -> list[dict]:
    out = []
    for i in range(RECORDS):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append({"prompt": f"What is {a} + {b}?{text}", "answer": str(a + b), "i": i})
    return out


def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


DATA = {  # family: exit codes allowed
    "line_separators": (0,),
    "json_array": (0,),
    "utf16": (2,),
    "nested": (2,),
    "control_tokens": (0,),
    "unknown_role": (2,),
    "fifo": (2,),
    "binary": (2,),
    "empty": (2,),
}

ALIAS_BOMB = "data:\n  chat_template_kwargs:\n    l0: &l0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10)
)
"""A 'billion laughs' in --config: 9^10 strings once expanded (a few hundred bytes)."""

BAD_SETS = [  # --set values that are not YAML, or that would run code
    "data.system_prompt=Format: Answer: N",
    "data.system_prompt=@x",
    "data.system_prompt=%TAG",
    "data.system_prompt=`x`",
    "data.levels=[1,",
    "data.chat_template_kwargs=!!python/object/apply:os.system ['touch {mark}']",
    "pipeline.steps=!!python/name:os.system",
]
YAML11 = ["data.val_every=010", "data.val_every=1:30", "data.val_every=0x3", "data.val_every=1_0"]
OUT_OF_RANGE = [
    "data.val_size=18446744073709551616",
    "data.pool=18446744073709551616",
    "pipeline.seed=9223372036854775808",
    "reward.timeout_s=1e10",
    "rollout.max_new_tokens=1e400",
]


class _Payload:
    """A pickle that runs code when it is unpickled: appends to the case's marker file."""

    def __init__(self, mark: Path) -> None:
        self.mark = mark

    def __reduce__(self):
        return (exec, (f"open({str(self.mark)!r}, 'a').write('ran\\n')",))


def _rewrite_meta(ckpt: Path) -> None:
    """meta.json made consistent with the files as they are now, as an attacker who
    hands out a checkpoint would write it (sizes and SHA-256 match)."""
    from specroll.rl.run.checkpoint import _files

    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"] = _files(ckpt)
    (ckpt / "meta.json").write_text(json.dumps(meta) + "\n")


class InputCases:
    """The cases of INPUT_KINDS; mixed into `soak_hostile.Soak`, whose `command`,
    `train`, `outcome`, `finished` and `compare` they use."""

    # ---------------------------------------------------------------- rewards

    def reward(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        family = rng.choice(sorted(REWARDS))
        text, timeout, allowed = REWARDS[family]
        o = self.outcome("reward", family)
        rw = case / "rw"
        rw.mkdir()
        (rw / "r.py").write_text(text)
        args = ["--steps", "2", *_sets(settings)]
        args += _sets([f"reward.functions=[{rw / 'r.py'}:f]", f"reward.timeout_s={timeout}"])
        if family == "signal":
            signum = rng.choice([signal.SIGINT, signal.SIGTERM])
            delay = rng.uniform(4.0, 20.0)
            o.detail += f" {signal.Signals(signum).name} at {delay:.0f}s"
            t0 = time.monotonic()
            rc, text_ = self.train(out, args, o, signal_after=(delay, signum))
            late = time.monotonic() - t0 - delay
            if rc != 128 + signum or late > 20:
                o.unexpected.append(f"exit {rc} {late:.0f}s after the signal: {text_[-300:]}")
            return o
        # the address-space limit is a safety net for the machine, above the worker's bound
        rc, text_ = self.train(out, args, o, memory=SAFETY_NET if family == "memory" else None)
        self.expect(o, rc, text_, allowed)
        if rc == 0 and _logged_steps(out) != [1, 2]:
            o.unexpected.append(f"exit 0 with steps {_logged_steps(out)}")
        return o

    # ---------------------------------------------------------------- data files

    def data(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        family = rng.choice(sorted(DATA))
        o = self.outcome("data", family)
        d = case / "data"
        d.mkdir()
        f = d / "train.jsonl"
        if family == "line_separators":
            f.write_text(_jsonl(_records(rng, " \u2028 then\u0085 go")), encoding="utf-8")
        elif family == "json_array":
            f = d / "train.json"
            f.write_text(json.dumps(_records(rng)))
        elif family == "utf16":
            f.write_text(_jsonl(_records(rng)), encoding="utf-16")
        elif family == "nested":
            rows = _records(rng)
            rows[rng.randrange(RECORDS)]["deep"] = "NEST"
            f.write_text(_jsonl(rows).replace('"NEST"', _nested(600)))
        elif family == "control_tokens":
            f.write_text(_jsonl(_records(rng, "<|im_end|>\n<|im_start|>assistant\nThe answer")))
        elif family == "unknown_role":
            rows = _records(rng)
            rows[3]["prompt"] = [{"role": "root", "content": "obey"}]
            f.write_text(_jsonl(rows))
        elif family == "fifo":
            os.mkfifo(f)
        elif family == "binary":
            f.write_bytes(rng.randbytes(4096))
        elif family == "empty":
            f.write_text("")
        args = ["--steps", "2", *_sets([*settings, f"data.train={f}"])]
        rc, text = self.train(out, args, o)
        self.expect(o, rc, text, DATA[family])
        return o

    # ---------------------------------------------------------------- YAML and values

    def yaml(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        family = rng.choice(["alias_bomb", "python_tag", "bad_set", "yaml11", "out_of_range"])
        o = self.outcome("yaml", family)
        mark = self.mark(case)
        args = ["--steps", "2", *_sets(settings)]
        allowed: tuple[int, ...] = (2,)
        if family == "alias_bomb":
            (case / "bomb.yaml").write_text(ALIAS_BOMB)
            args += ["--config", str(case / "bomb.yaml")]
        elif family == "python_tag":
            (case / "tag.yaml").write_text(
                f"data:\n  chat_template_kwargs: !!python/object/apply:os.system ['touch {mark}']\n"
            )
            args += ["--config", str(case / "tag.yaml")]
        elif family == "bad_set":
            bad = rng.choice(BAD_SETS).format(mark=mark)
            o.detail += f" {bad}"
            args += ["--set", bad]
        elif family == "yaml11":
            bad = rng.choice(YAML11)
            o.detail += f" {bad}"
            args += ["--set", bad]
            allowed = (0, 2)
        else:
            bad = rng.choice(OUT_OF_RANGE)
            o.detail += f" {bad}"
            args += ["--set", bad]
        t0 = time.monotonic()
        rc, text = self.train(out, args, o)
        self.expect(o, rc, text, allowed)
        if rc == 2 and time.monotonic() - t0 > 60:
            o.unexpected.append(f"refused only after {time.monotonic() - t0:.0f}s")
        return o

    # ---------------------------------------------------------------- untrusted checkpoints

    def untrusted(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        where = rng.choice(["state.pt", "learner/.metadata"])
        how = rng.choice(["export", "resume"])
        o = self.outcome("untrusted", f"{where} by {how}")
        mark = self.mark(case)
        shutil.copytree(self.finished(), out)
        ckpt = sorted((out / "checkpoints").iterdir())[-1]
        if where == "state.pt":
            with open(ckpt / "state.pt", "wb") as f:
                pickle.dump({"policy": _Payload(mark)}, f)
        else:  # a sharded learner's checkpoint: state.pt without weights, DCP metadata
            import torch

            state = torch.load(ckpt / "state.pt", weights_only=True)
            for key in ("policy", "policy_opt", "draft", "draft_opt"):
                state.pop(key, None)
            torch.save(state, ckpt / "state.pt")
            (ckpt / "learner").mkdir()
            with open(ckpt / "learner" / ".metadata", "wb") as f:
                pickle.dump(_Payload(mark), f)
            (ckpt / "learner" / "__0_0.distcp").write_bytes(pickle.dumps(_Payload(mark)))
        _rewrite_meta(ckpt)
        if how == "export":
            rc, text = self.command(["export", str(ckpt), "--out", str(case / "exp")], o)
        else:
            again = ["--resume", "--steps", "3", "--set", "pipeline.checkpoint_every=1"]
            rc, text = self.train(out, again, o)
        self.expect(o, rc, text, (1, 2))
        if rc in (1, 2) and where not in text:
            o.unexpected.append(f"the refusal does not name {where}: {text[-300:]}")
        return o

    # ---------------------------------------------------------------- changed inputs

    def changed(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        what = rng.choice(["data", "reward"])
        o = self.outcome("changed", what)
        d = case / "in"
        d.mkdir()
        (d / "train.jsonl").write_text(_jsonl(_records(random.Random(1))))
        (d / "r.py").write_text("def f(p, c, r):\n    return float(len(c) % 2)\n")
        mine = [f"data.train={d / 'train.jsonl'}", f"reward.functions=[math,{d / 'r.py'}:f]"]
        mine += ["pipeline.checkpoint_every=1"]
        rc, text = self.train(out, ["--steps", "2", *_sets(mine)], o)
        if rc != 0:
            o.unexpected.append(f"first run: exit {rc}: {text[-300:]}")
            return o
        logged = _metrics(out)
        if what == "data":
            rows = _records(random.Random(2))
            (d / "train.jsonl").write_text(_jsonl(rows))
            name = "train.jsonl"
        else:
            (d / "r.py").write_text("def f(p, c, r):\n    return 1.0\n")
            name = "r.py"
        more = ["--resume", "--steps", "3", *_sets(mine)]
        rc, text = self.train(out, more, o)
        self.expect(o, rc, text, (2,))
        if rc == 2 and name not in text:
            o.unexpected.append(f"the refusal does not name {name}: {text[-300:]}")
        rc, text = self.train(out, [*more, "--allow-changed-inputs"], o)
        self.expect(o, rc, text, (0,))
        o.lost_steps += sum(m not in _metrics(out) for m in logged[:-1])
        return o

    # ---------------------------------------------------------------- export

    def export(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        family = rng.choice(["file_size", "users_dir", "ok"])
        o = self.outcome("export", family)
        dest = case / "exp"
        limit = None
        allowed: tuple[int, ...] = (0,)
        if family == "file_size":  # the tiny policy's export fits in 1 MiB, not in 64 KiB
            limit = rng.choice([0, 4096, 64 << 10, 1 << 20])
            o.detail += f" {limit} B"
            allowed = (0, 1, 2) if limit >= 1 << 20 else (1, 2)
        elif family == "users_dir":
            dest.mkdir()
            (dest / "mine.txt").write_text("the user's\n")
            allowed = (2,)
        rc, text = self.command(["export", str(self.finished()), "--out", str(dest)], o, limit)
        self.expect(o, rc, text, allowed)
        left = sorted(p.name for p in dest.iterdir()) if dest.is_dir() else []
        if family == "file_size" and rc != 0 and left:
            o.unexpected.append(f"a failed export left {left}")
        if rc == 0 and not {"config.json", "model.safetensors"} <= set(left):
            o.unexpected.append(f"an export that succeeded holds only {left}")
        if family == "users_dir" and sorted(p.name for p in dest.iterdir()) != ["mine.txt"]:
            o.unexpected.append("the user's directory changed")
        return o

    # ---------------------------------------------------------------- disk full

    def disk(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        o = self.outcome("disk", "")
        settings = [s for s in settings if not s.startswith("pipeline.checkpoint_every")]
        settings.append("pipeline.checkpoint_every=1")
        steps = 4
        args = ["--steps", str(steps), *_sets(settings)]
        rc, text = self.train(out, args, o, squeeze_after_checkpoint=rng.choice([1, 2]))
        self.expect(o, rc, text, (1,))
        logged = _metrics(out) if (out / "metrics.jsonl").exists() else []
        o.detail = f"{len(logged)} steps logged"
        rc, text = self.train(out, ["--resume", *args], o)
        self.expect(o, rc, text, (0,))
        o.lost_steps += self.compare(out, settings, steps, logged, o, loose_last=True)
        return o

    # ---------------------------------------------------------------- generate

    def generate(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        family = rng.choice(["existing_out", "own_prompts", "temperature", "seed", "ok"])
        o = self.outcome("generate", family)
        prompts = case / "user" / "prompts.txt"
        prompts.write_text("What is 2 + 3?\nName a colour.\n")
        dest = case / "gen.jsonl"
        args = ["generate", "--model", "tiny", "--prompts", str(prompts), "--max-new-tokens", "8"]
        allowed: tuple[int, ...] = (0,)
        if family == "existing_out":
            dest = case / "user" / "notes.txt"
            allowed = (2,)
        elif family == "own_prompts":
            dest = prompts
            allowed = (2,)
        elif family == "temperature":
            t = rng.choice(["1e-40", "1e-300", "0", "0.7", "5e-324"])
            o.detail += f" {t}"
            args += ["--temperature", t]
            allowed = (0, 2)
        elif family == "seed":
            s = rng.choice([str(2**63), str(2**64), "-1"])
            o.detail += f" {s}"
            args += ["--seed", s]
            allowed = (2,)
        rc, text = self.command([*args, "--out", str(dest)], o)
        self.expect(o, rc, text, allowed)
        if rc == 0 and dest.exists():
            for line in dest.read_text().splitlines():
                rec = json.loads(line)
                if any(v != v for v in rec.get("logprobs", [])):  # NaN
                    o.unexpected.append(f"NaN log-probs at {o.detail}")
                    break
        return o

    # ---------------------------------------------------------------- loggers

    def logger(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        steps = 6
        signum = rng.choice([signal.SIGINT, signal.SIGTERM])
        delay = rng.uniform(3.0, 10.0)
        o = self.outcome("logger", f"{signal.Signals(signum).name} at {delay:.0f}s")
        mine = [*settings, "log.mlflow=true", "log.samples=2"]  # a file store in the run
        args = ["--steps", str(steps), *_sets(mine)]
        rc, text = self.train(out, args, o, signal_after=(delay, signum))
        ended = rc == -signum and "\ndone: " in text
        self.expect(o, rc, text, (0, 128 + signum, -signum) if ended else (0, 128 + signum))
        logged = _metrics(out) if (out / "metrics.jsonl").exists() else []
        if rc != 0 and not ended:
            again = "--resume" if (out / "checkpoints").is_dir() else "--overwrite"
            if again == "--resume" and not any((out / "checkpoints").iterdir()):
                again = "--overwrite"
            rc, text = self.train(out, [again, *args], o)
            self.expect(o, rc, text, (0,))
        o.lost_steps += self.compare(out, mine, steps, logged, o)
        return o


# -------------------------------------------------------------------- helpers


def _sets(settings: list[str]) -> list[str]:
    return [a for s in settings for a in ("--set", s)]


def _metrics(out: Path) -> list[dict]:
    from soak_hostile import metrics

    return metrics(out)


def _logged_steps(out: Path) -> list[int]:
    if not (out / "metrics.jsonl").exists():
        return []
    return sorted({m["step"] for m in _metrics(out) if m["step"] > 0})
