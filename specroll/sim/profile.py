"""`specroll bench profile`: measure this machine, fit the cost model, save a profile.

Two kinds of measurement, both in this process:
* the target's forward alone over a grid of (active rows B, tokens per row q, context
  c), each point the median of several timed runs on a warm cache;
* real speculative engine runs with the drafter at several (B, k), from which the
  per-iteration draft time and the verification/bookkeeping overhead are read off the
  engine's own timers (`SpecStats`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from specroll.drafters.base import Drafter
from specroll.engine.depth import FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.request import Request, SamplingParams
from specroll.model.transformer import KVCache, Transformer
from specroll.sim.costmodel import CostModel, fit_features, fit_linear, fit_target


@torch.inference_mode()
def time_forward(model: Transformer, B: int, q: int, ctx: int, repeats: int = 5) -> float:
    """Median seconds of one forward adding q tokens to B rows at context ctx."""
    cache = KVCache(model.cfg, B, ctx + q)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.vocab_size, (B, q), generator=g)
    pos = torch.full((B,), ctx, dtype=torch.long)
    model(tokens, positions=pos, cache=cache)  # warm-up (and weight packing)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(tokens, positions=pos, cache=cache)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile(
    model: Transformer,
    drafter: Drafter | None,
    prompts: list[list[int]],
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    qs: tuple[int, ...] = (1, 2, 4, 8),
    ctxs: tuple[int, ...] = (64, 256, 1024),
    engine_batches: tuple[int, ...] = (1, 2, 4, 8),
    engine_ks: tuple[int, ...] = (1, 3, 5),
    new_tokens: int = 48,
    repeats: int = 5,
    log: Callable[[str], None] = print,
) -> CostModel:
    """Measure and fit; `prompts` (token ids) feed the engine runs."""
    points = []
    for ctx in ctxs:
        if ctx + max(qs) > model.cfg.max_position_embeddings:
            continue
        for B in batches:
            for q in qs:
                s = time_forward(model, B, q, ctx, repeats)
                points.append({"B": B, "q": q, "ctx": ctx, "seconds": s})
        log(f"target forward at context {ctx}: {len(points)} points")
    coef, err = fit_target(points)
    cm = CostModel(**coef)
    engine_pts = []
    if drafter is not None:
        for B in engine_batches:
            reqs = [
                Request(
                    prompts[i % len(prompts)],
                    SamplingParams(1.0, max_new_tokens=new_tokens, stop_token_ids=(), seed=i),
                )
                for i in range(B)
            ]
            for k in engine_ks:
                eng = Engine(model, EngineConfig(max_batch=B), drafter, FixedDepth(k))
                eng.generate(reqs[:1])  # warm-up
                eng.generate(reqs)
                s = eng.stats
                it = max(s.target_forwards, 1)
                engine_pts.append(
                    {"B": B, "k": k, "draft_s": s.draft_s / it, "other_s": s.other_s / it}
                )
            log(f"engine with drafter {drafter.name} at batch {B}: k = {list(engine_ks)}")
        feats = [[1.0, p["B"], p["k"], p["k"] * p["B"]] for p in engine_pts]
        d, d_err = fit_features(feats, [p["draft_s"] for p in engine_pts])
        o0, o1, o_err = fit_linear(
            [p["B"] * (p["k"] + 1) for p in engine_pts], [p["other_s"] for p in engine_pts]
        )
        cm.draft_fixed, cm.draft_per_row, cm.draft_step, cm.draft_step_per_row = d
        cm.overhead_fixed, cm.overhead_per_token = o0, o1
        err.update(draft_mape=round(d_err, 4), overhead_mape=round(o_err, 4))
    cm.meta = {
        "threads": torch.get_num_threads(),
        "fit_error": err,
        "target_points": points,
        "engine_points": engine_pts,
        "drafter": None if drafter is None else drafter.name,
    }
    return cm
