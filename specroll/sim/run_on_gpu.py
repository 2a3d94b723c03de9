"""A finished run's measured acceptance, simulated on one GPU: what its drafts would buy
in generation there (simulated, not measured).

A run on a small machine measures acceptance well but its speed-up badly: on a CPU plain
decoding is cheap at large batch, so the engine seldom drafts and `gen_speedup` says
little about a GPU. Acceptance belongs to the draft and the policy's outputs, not to the
hardware, so it carries over; the simulator supplies the GPU's step times (`stepmodel`)
and the continuous batching (`rollout`). The acceptance comes from the run's metrics:

* `engine`: the engine's measured per-position acceptance (`per_position`, cumulative)
  when the steps drafted at least `MIN_ENGINE_TOKENS` tokens; metrics record decode
  iterations by depth (`depth_hist`), not rows, so the count is a lower bound (one row
  per drafting iteration);
* else `draft_accept`: the online draft's expected acceptance per draft position,
  estimated while it trained on the run's rollouts (the kept groups' responses).

Both are read over the second half of the run's steps (the draft has adapted by then).
The workload is the last step's response lengths at the run's batch size; the depth is
chosen per iteration (0..the positions measured) as the engine's adaptive policy does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from specroll.sim.catalogue import HARDWARE, ModelSpec, model_spec
from specroll.sim.rlstep import Cluster, RLSim
from specroll.sim.rollout import Speculation, Workload, simulate_rollout
from specroll.sim.stepmodel import AnalyticStep

MIN_ENGINE_TOKENS = 1000
"""Drafted tokens (lower bound) the engine's own acceptance must rest on to be used."""
MIN_POSITION_TOKENS = 100
"""Drafted tokens (lower bound) a draft position needs for its acceptance to be used."""
PROMPT_LEN = 256
"""Prompt tokens assumed (metrics do not record prompt lengths)."""
ALIASES = {"smollm2": "smollm2-135m", "default": "smollm2-135m"}
"""specroll's default policy names (`model.hub`) → catalogue entries."""


@dataclass
class RunAcceptance:
    """Per-position acceptance read from a run's metrics, and what it rests on."""

    source: str
    """'engine' (measured while drafting) or 'draft_accept' (the online draft's estimate)."""
    alphas: list[float]
    """Conditional acceptance alpha_1..alpha_k (the simulator's `Speculation.alphas`)."""
    tokens: int
    """Tokens it rests on: drafted tokens, at least (engine), or trained response
    tokens, about (draft_accept)."""
    steps: tuple[int, int]
    """First and last RL step read."""

    def describe(self) -> str:
        """'engine's measured acceptance, steps 6-10, >= 1200 drafted tokens' and alike."""
        a, b = self.steps
        span = f"step {a}" if a == b else f"steps {a}-{b}"
        if self.source == "engine":
            return f"engine's measured acceptance, {span}, >= {self.tokens} drafted tokens"
        return f"online draft's draft_accept, {span}, ~{self.tokens} trained tokens"


@dataclass
class GpuEstimate:
    """Simulated generation of a run's last step on one GPU, plain vs speculative."""

    gen_speedup: float
    """Plain generation time over speculative, simulated."""
    k: int
    """The draft depth the simulated iterations used most (0 = plain)."""
    gpu: str
    """Catalogue hardware name (`catalogue.HARDWARE`)."""
    model: str
    """The policy's shape (catalogue name or its config's)."""
    acceptance: RunAcceptance
    """What acceptance it was fed, from where."""
    depth_hist: list[int] = field(default_factory=list)
    """Simulated decode iterations by draft depth (0 = plain)."""
    samples: int = 0
    """Responses in the simulated step."""
    batch: int = 0
    """Sequences decoded at once."""

    def line(self) -> str:
        """The report's sentence, labelled simulated."""
        return (
            f"simulated on one {self.gpu.upper()} with this run's acceptance "
            f"(source: {self.acceptance.describe()}): generation x{self.gen_speedup:.2f} "
            f"(k={self.k}) — simulated, not measured"
        )

    def summary(self) -> dict:
        """The run summary's figures: `simulated_gen_speedup` and its basis."""
        basis = (
            f"one {self.gpu.upper()}, {self.model}, {self.samples} responses at batch "
            f"{self.batch}, k={self.k}; acceptance: {self.acceptance.describe()}; "
            "simulated, not measured"
        )
        return {"simulated_gen_speedup": round(self.gen_speedup, 4), "simulated_gen_basis": basis}


def _window(rows: Sequence[dict]) -> list[dict]:
    """The second half of the run's steps (at least the last one)."""
    steps = [r for r in rows if "time" in r]
    return steps[len(steps) // 2 :]


def _finite(xs) -> bool:
    return isinstance(xs, list) and bool(xs) and all(_num(x) for x in xs)


def _num(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def engine_acceptance(rows: Sequence[dict]) -> RunAcceptance | None:
    """The engine's pooled per-position acceptance (None under `MIN_ENGINE_TOKENS`)."""
    acc: list[float] = []
    drafted: list[float] = []
    used = []
    for r in _window(rows):
        cum, hist = r.get("per_position"), r.get("depth_hist") or []
        if not _finite(cum):
            continue
        # iterations that drafted more than i tokens: at least one row each
        d = [sum(hist[i + 1 :]) for i in range(len(cum))]
        if not d[0]:
            continue
        used.append(r["step"])
        for i, (c, n) in enumerate(zip(cum, d, strict=True)):
            if i == len(acc):
                acc.append(0.0)
                drafted.append(0.0)
            acc[i] += c * n
            drafted[i] += n
    tokens = int(sum(drafted))
    if tokens < MIN_ENGINE_TOKENS:
        return None
    alphas, prev = [], 1.0
    for a, n in zip(acc, drafted, strict=True):
        if n < MIN_POSITION_TOKENS:
            break
        c = a / n
        alphas.append(min(1.0, c / prev) if prev > 0 else 0.0)
        prev = c
    return RunAcceptance("engine", alphas, tokens, (used[0], used[-1]))


def draft_acceptance(rows: Sequence[dict]) -> RunAcceptance | None:
    """The online draft's `draft_accept`, each position weighted by the tokens it trained
    on (steps may have unrolled different depths)."""
    sums: list[float] = []
    weights: list[float] = []
    used = []
    for r in _window(rows):
        a = r.get("draft_accept")
        if not _finite(a):
            continue
        kept, groups = r.get("groups_kept"), r.get("groups")
        share = kept / groups if _num(kept) and _num(groups) and groups > 0 else 1.0
        w = float(r.get("gen_tokens") or 0) * share or 1.0  # trained tokens, about
        sums += [0.0] * (len(a) - len(sums))
        weights += [0.0] * (len(a) - len(weights))
        for i, x in enumerate(a):
            sums[i] += w * min(max(float(x), 0.0), 1.0)
            weights[i] += w
        used.append(r["step"])
    if not used:
        return None
    alphas = [s / w for s, w in zip(sums, weights, strict=True)]
    return RunAcceptance("draft_accept", alphas, round(weights[0]), (used[0], used[-1]))


def run_acceptance(rows: Sequence[dict], chain: bool = True) -> RunAcceptance | None:
    """The engine's acceptance if it rests on enough drafted tokens (chains only: a tree's
    per-position acceptance is along its accepted path), else the online draft's, else
    None (nothing drafted, no draft trained)."""
    return (engine_acceptance(rows) if chain else None) or draft_acceptance(rows)


def policy_model(config: str | Path | None, name: str) -> ModelSpec | None:
    """The policy's shape: its config.json (a file or a model directory) when there is
    one, else the catalogue entry of `name`; None when neither is known."""
    if config is not None and Path(config).exists():
        try:
            return replace(ModelSpec.from_config(config), name=name)
        except ValueError:
            pass
    try:
        return model_spec(ALIASES.get(name.lower(), name))
    except ValueError:
        return None


def _lengths(rows: Sequence[dict]) -> list[int] | None:
    """The last step's response lengths (what `specroll simulate --lengths-from` reads)."""
    for r in reversed(rows):
        got = r.get("response_lengths")
        if isinstance(got, list) and got:
            return [max(1, int(x)) for x in got]
    return None


def simulate_on_gpu(
    rows: Sequence[dict],
    model: ModelSpec,
    gpu: str = "h100",
    max_batch: int = 1024,
    prompt_len: int = PROMPT_LEN,
    draft_vocab: int = 32000,
    chain: bool = True,
) -> GpuEstimate | None:
    """Generation speed-up the run's acceptance (`run_acceptance`) would give on one `gpu`
    for its last step's responses, decoding up to `max_batch` at once, with the draft
    costed as one EAGLE-3 layer of `model` (`draft_vocab` rows); None when the metrics
    hold no usable acceptance or no response lengths. ValueError when the model does not
    fit on the GPU."""
    acc = run_acceptance(rows, chain)
    lengths = _lengths(rows)
    if acc is None or not acc.alphas or lengths is None:
        return None
    hw = HARDWARE[gpu.lower()]
    arr = np.array(lengths, dtype=np.float64)  # [samples]
    work = Workload(prompt_len=prompt_len, mean_len=float(arr.mean()), max_len=int(arr.max()))
    batch = RLSim(model, hw, Cluster(gpus=1, max_seqs=max_batch), work).concurrency()
    step = AnalyticStep(model, hw, draft_vocab=draft_vocab)
    spec = Speculation(k=len(acc.alphas), alphas=list(acc.alphas), adaptive=True)
    plain = simulate_rollout(step, arr, 1, batch, prompt_len, Speculation())
    drafted = simulate_rollout(step, arr, 1, batch, prompt_len, spec)
    hist = list(drafted["depth_hist"])
    return GpuEstimate(
        gen_speedup=plain["gen_s"] / drafted["gen_s"],
        k=max(range(len(hist)), key=lambda k: hist[k]),
        gpu=hw.name,
        model=model.name,
        acceptance=acc,
        depth_hist=hist,
        samples=len(lengths),
        batch=batch,
    )
