"""The soak's cases of models, drafts, adapters, profiles and data from elsewhere (issue
58), beside issues 30 and 44's (`soak_hostile.py --areas foreign` runs them). Each case
draws one area and one kind of trouble in it:

  sizes      a model's or an EAGLE-3 draft's config.json with one size out of its bound
             (300M positions, a 2^30 vocabulary, 1e10 as a float, head_dim 0, 100,000
             layers, a negative norm epsilon), or a 16M-position window within it (which
             must run, allocating what the run reaches, not what the file says)
  fifos      a FIFO in place of a model's weights, config or tokenizer file, a draft's
             weights or config, an adapter's weights or config, a cost profile, a
             --config file or a data file: refused at once, never waited on
  nonfinite  NaN or infinity in a model's or a draft's weights, an adapter's weights or
             lora_alpha, a draft config's epsilon, a cost profile, or --set lora.alpha
  bigdata    a JSONL training file of 100k to 1M records: its time, peak memory and
             progress lines
  profiles   a cost profile from elsewhere that is negative, NaN, 1e300, cut short or not
             an object (refused by name), or the cached profile damaged (measured again)

Counted as the other areas are: exits, tracebacks, hangs, peak RSS; a refusal must be one
`error:` line, within FIFO_S seconds for a FIFO.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

FOREIGN_KINDS = ("sizes", "fifos", "nonfinite", "bigdata", "profiles")
FIFO_S = 30
"""Seconds within which a FIFO must be refused (a reader waiting on it would hang until
the soak's timeout)."""
SAFETY_NET = 16 << 30
"""Address-space limit of a case whose config asks for more than the machine."""
SIZES = [  # (field, value, exit code)
    ("max_position_embeddings", 300_000_000, 2),
    ("max_position_embeddings", 1 << 24, 0),
    ("vocab_size", 1 << 30, 2),
    ("intermediate_size", 1e10, 2),
    ("head_dim", 0, 2),
    ("num_hidden_layers", 100_000, 2),
    ("rms_norm_eps", -1, 2),
]
FIFO_TARGETS = (
    "model/model.safetensors",
    "model/config.json",
    "model/tokenizer.json",
    "model/tokenizer_config.json",
    "draft/model.safetensors",
    "draft/config.json",
    "adapter/adapter_model.safetensors",
    "adapter/adapter_config.json",
    "profile.json",
    "config.yaml",
    "train.jsonl",
)
ADAPTIVE = ("--set", "rollout.depth=adaptive")
NONFINITE = ("model", "draft", "adapter", "alpha", "eps", "profile", "set_alpha")
PROFILES = {
    "negative": '{"fixed": -1, "per_token": -1, "knee": 1}',
    "nan": '{"fixed": NaN, "per_token": 1e-4, "knee": 1}',
    "huge": '{"fixed": 1e300, "per_token": 1e-4, "knee": 1}',
    "cut": '{"fixed": 0.001, "per_tok',
    "list": "[1, 2, 3]",
}


def _files(case: Path) -> dict[str, Path]:
    """A tiny policy, an EAGLE-3 draft of it, a rank-2 adapter, a profile, a config and a
    data file, all in `case`, as a user would have been handed them."""
    import torch
    from safetensors.torch import save_file

    from specroll.drafting.eagle3_head import Eagle3Config, Eagle3Head
    from specroll.drafting.eagle3_io import save_eagle3
    from specroll.model.tiny import build_tiny
    from specroll.model.weights import load_model

    model = build_tiny(case / "model")
    policy = load_model(model)
    head = Eagle3Head(Eagle3Config.for_target(policy.cfg), policy)
    head.init_weights(0, std=0.05)
    save_eagle3(head, case / "draft")
    ad = case / "adapter"
    ad.mkdir()
    cfg = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    pre, c = "base_model.model.model.layers", policy.cfg
    t = {}
    for i in range(c.num_layers):
        t[f"{pre}.{i}.self_attn.q_proj.lora_A.weight"] = torch.full((2, c.hidden_size), 0.01)
        t[f"{pre}.{i}.self_attn.q_proj.lora_B.weight"] = torch.zeros(c.q_size, 2)
    save_file(t, ad / "adapter_model.safetensors")
    (case / "profile.json").write_text('{"fixed": 0.001, "per_token": 0.0001, "knee": 8}')
    (case / "config.yaml").write_text("rollout:\n  k: 2\n")
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(40)]
    (case / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": model, "draft": case / "draft", "adapter": ad, "case": case}


def _edit_json(path: Path, **fields) -> None:
    raw = json.loads(path.read_text())
    raw.update(fields)
    path.write_text(json.dumps(raw))


def _poison(path: Path, value: float) -> None:
    """Put `value` in the first element of the first floating tensor of `path`."""
    from safetensors.torch import load_file, save_file

    t = load_file(path)
    name = next(n for n, x in t.items() if x.is_floating_point())
    t[name].view(-1)[0] = value
    save_file(t, path)


class ForeignCases:
    """The cases of FOREIGN_KINDS; mixed into `soak_hostile.Soak` (its `command`,
    `train`, `outcome` and `expect`)."""

    def _generate(self, f: dict, o, drafter: bool = False, **trouble):
        args = ["generate", "--model", str(f["model"]), "--prompt", "hi", "--max-new-tokens", "4"]
        if drafter:
            args += ["--drafter", f"eagle3:{f['draft']}"]
        return self.command(args, o, **trouble)

    def sizes(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        field, value, want = rng.choice(SIZES)
        where = rng.choice(["model", "draft"])
        o = self.outcome("sizes", f"{where} {field}={value}")
        f = _files(case)
        _edit_json(f[where] / "config.json", **{field: value})
        rc, text = self._generate(f, o, drafter=where == "draft", memory=SAFETY_NET)
        self.expect(o, rc, text, (want,))
        if want == 0 and o.peak_rss_mb > 2048:
            o.unexpected.append(f"a {value}-position window took {o.peak_rss_mb:.0f} MB")
        return o

    def fifos(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        target = rng.choice(FIFO_TARGETS)
        o = self.outcome("fifos", target)
        f = _files(case)
        path = case / target
        path.unlink()
        os.mkfifo(path)
        top = target.split("/")[0]
        t0 = time.monotonic()
        if top in ("model", "draft"):
            rc, text = self._generate(f, o, drafter=top == "draft")
        else:
            extra = {
                "adapter": ["--set", f"lora.init={f['adapter']}"],
                "profile.json": [
                    "--set",
                    "rollout.depth=adaptive",
                    "--set",
                    f"rollout.profile={path}",
                ],
                "config.yaml": ["--config", str(path)],
                "train.jsonl": ["--set", f"data.train={path}"],
            }[top]
            rc, text = self.train(out, ["--steps", "1", *extra], o)
        self.expect(o, rc, text, (2,))
        if time.monotonic() - t0 > FIFO_S:
            o.unexpected.append(f"refused only after {time.monotonic() - t0:.0f}s")
        return o

    def nonfinite(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        where, value = rng.choice(NONFINITE), rng.choice([float("nan"), float("inf")])
        o = self.outcome("nonfinite", f"{where} {value}")
        f = _files(case)
        args = ["--steps", "1"]
        if where in ("model", "draft"):
            _poison(f[where] / "model.safetensors", value)
            rc, text = self._generate(f, o, drafter=where == "draft")
        else:
            if where == "adapter":
                _poison(f["adapter"] / "adapter_model.safetensors", value)
                args += ["--set", f"lora.init={f['adapter']}"]
            elif where == "alpha":
                _edit_json(f["adapter"] / "adapter_config.json", lora_alpha=value)
                args += ["--set", f"lora.init={f['adapter']}"]
            elif where == "eps":
                _edit_json(f["draft"] / "config.json", rms_norm_eps=value)
                args += ["--set", f"draft.init={f['draft']}"]
            elif where == "profile":
                (case / "profile.json").write_text(f'{{"fixed": {value}, "per_token": 1e-4}}')
                args += ["--set", "rollout.depth=adaptive"]
                args += ["--set", f"rollout.profile={case / 'profile.json'}"]
            else:
                args += [
                    "--set",
                    "lora.rank=2",
                    "--set",
                    f"lora.alpha={'1e308' if value > 0 else 'nan'}",
                ]
            rc, text = self.train(out, args, o)
        self.expect(o, rc, text, (2,))
        return o

    def bigdata(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        n = rng.choice([100_000, 300_000, 1_000_000])
        data = case / "big.jsonl"
        with data.open("w") as w:
            for i in range(n):
                w.write(json.dumps({"prompt": f"What is {i} + {i % 7}?", "answer": str(i + i % 7)}))
                w.write("\n")
        o = self.outcome("bigdata", f"{n} records, {data.stat().st_size >> 20} MiB")
        t0 = time.monotonic()
        rc, text = self.train(out, ["--steps", "1", "--set", f"data.train={data}"], o)
        took = time.monotonic() - t0
        o.detail += f", {took:.0f}s"
        self.expect(o, rc, text, (0,))
        if "reading data.train (lines)" not in text:
            o.unexpected.append("no progress line while the data file was read")
        if took > 120:
            o.unexpected.append(f"a 1-step run on {n} records took {took:.0f}s")
        return o

    def profiles(self, case: Path, out: Path, settings: list[str], rng: random.Random):
        family = rng.choice(sorted(PROFILES))
        cached = rng.random() < 0.5
        o = self.outcome("profiles", f"{family} {'cached' if cached else 'given'}")
        args = ["--steps", "1", "--set", "rollout.depth=adaptive"]
        if not cached:
            (case / "profile.json").write_text(PROFILES[family])
            rc, text = self.train(
                out, [*args, "--set", f"rollout.profile={case / 'profile.json'}"], o
            )
            self.expect(o, rc, text, (2,))
            return o
        import torch

        self.finished()  # the tiny policy is in SPECROLL_HOME
        home_dir = Path(self.env["SPECROLL_HOME"])
        c = json.loads((home_dir / "models" / "tiny-v1" / "config.json").read_text())
        key = f"{c['num_hidden_layers']}x{c['hidden_size']}-v{c['vocab_size']}"
        name = f"{key}-t{torch.get_num_threads()}-eagle3.json"
        cache = home_dir / "profiles"
        cache.mkdir(parents=True, exist_ok=True)
        (cache / name).write_text(PROFILES[family])
        rc, text = self.train(out, args, o)
        self.expect(o, rc, text, (0,))
        if "not used, removed" not in text:
            o.unexpected.append(f"the damaged cache {name} was not reported")
        shutil.rmtree(cache, ignore_errors=True)
        return o
