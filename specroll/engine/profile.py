"""`specroll bench profile`: measure this machine, fit the cost model, save a profile.

Two kinds of measurement, both in this process:
* the target's forward alone over a grid of (active rows B, tokens per row q, context
  c), each point the median of several timed runs on a warm cache;
* real speculative engine runs with the drafter at several (B, k), from which the
  per-iteration draft time and the verification/bookkeeping overhead are read off the
  engine's own timers (`SpecStats`);
* for a drafter of trees, engine runs over random trees of n nodes per row (`RandomTree`),
  whose iteration times beyond the fitted chain prediction are the tree terms.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specroll.device import synchronize, upload
from specroll.drafters.base import Drafter, Proposal
from specroll.engine.costmodel import CostModel, fit_features, fit_linear, fit_target
from specroll.engine.depth import FixedDepth
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.request import Request, SamplingParams
from specroll.model.kv_cache import KVCache
from specroll.model.transformer import Transformer

FORMAT = 2
"""Version of the cost model's terms; cached profiles of another version are re-measured."""


@torch.inference_mode()
def time_forward(
    model: Transformer, B: int, q: int, ctx: int, repeats: int = 5, cache: KVCache | None = None
) -> float:
    """Median seconds of one forward adding q tokens to B rows at context ctx (on the
    model's device and in its dtype, timed from and to an idle device). `cache`: one of
    at least B slots x ctx + q positions to reuse (allocating a large one costs more than
    the forwards timed in it)."""
    p = next(model.parameters())
    dev = p.device
    if cache is None:
        cache = KVCache(model.cfg, B, ctx + q, dtype=p.dtype, device=dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (B, q)
    tokens = torch.randint(0, model.cfg.vocab_size, shape, generator=g, device="cpu").to(dev)
    pos = torch.full((B,), ctx, dtype=torch.long, device=dev)
    model(tokens, positions=pos, cache=cache)  # warm-up (and weight packing)
    times = []
    for _ in range(repeats):
        synchronize(dev)
        t0 = time.perf_counter()
        model(tokens, positions=pos, cache=cache)
        synchronize(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class RandomTree(Drafter):
    """n random nodes per row every iteration, bushy: what scoring a tree of n nodes costs
    whatever its tokens (a forward's time does not depend on them); `chain`: n random
    tokens as a chain (the chain verifier), for comparison."""

    name = "random-tree"
    watch_collapse = False  # random candidates: misses are the point

    def __init__(self, vocab: int, seed: int = 0, chain: bool = False) -> None:
        self.vocab, self.g = vocab, torch.Generator().manual_seed(seed)
        self.tree = not chain

    def propose(self, batch) -> Proposal:
        B, k = batch.last.shape[0], batch.k
        tokens = torch.randint(0, self.vocab, (B, k), generator=self.g)
        dev = batch.last.device
        if not self.tree:
            return Proposal(tokens=upload(tokens, dev), probs=None)
        parents = torch.stack(
            [torch.randint(0, j + 1, (B,), generator=self.g) for j in range(k)], 1
        )
        return Proposal(tokens=upload(tokens, dev), probs=None, parents=upload(parents, dev))


def tree_terms(
    model: Transformer,
    cm: CostModel,
    requests: list[Request],
    batches: tuple[int, ...],
    nodes: tuple[int, ...],
    ctx: float,
) -> tuple[float, float, list[dict], float]:
    """Fit `cm`'s tree terms: engine iterations over random trees of n nodes per row at
    each batch size, less the chain prediction for k = n → (tree_fixed, tree_per_token,
    points, mape of the fit of the excess)."""
    pts = []
    for B in batches:
        for n in nodes:
            eng = Engine(
                model, EngineConfig(max_batch=B), RandomTree(model.cfg.vocab_size), FixedDepth(n)
            )
            eng.generate(requests[:1])  # warm-up
            s = eng.generate(requests[:B]).stats
            it = max(s.target_forwards, 1)
            seconds = (s.target_s + s.other_s) / it
            chain = cm.target(B, n + 1, ctx) + cm.overhead(B, n)
            pts.append({"B": B, "k": n, "seconds": seconds, "excess": seconds - chain})
    # a forward at least as cheap as the chain prediction has no tree term to fit
    xs = [p["B"] * (p["k"] + 1) for p in pts]
    ys = [max(p["excess"], 1e-6) for p in pts]
    a, b, err = fit_linear(xs, ys)
    return a, b, pts, err


def _engine_points(
    model: Transformer,
    drafter: Drafter,
    prompts: list[list[int]],
    engine_batches: tuple[int, ...],
    engine_ks: tuple[int, ...],
    new_tokens: int,
    log: Callable[[str], None],
) -> tuple[list[dict], list[Request]]:
    """Per-iteration draft and overhead seconds of real engine runs at each (B, k), and
    the last batch's requests. One engine per B serves every k (its buffers are sized for
    the largest; only the depth policy changes between runs), warmed up once."""
    pts: list[dict] = []
    reqs: list[Request] = []
    for B in engine_batches:
        reqs = [
            Request(
                prompts[i % len(prompts)],
                SamplingParams(1.0, max_new_tokens=new_tokens, stop_token_ids=(), seed=i),
            )
            for i in range(B)
        ]
        eng = Engine(model, EngineConfig(max_batch=B), drafter, FixedDepth(max(engine_ks)))
        eng.generate(reqs[:1])  # warm-up
        for k in engine_ks:
            # k = 0: a drafter attached (it stores features) that never drafts
            eng.depth = FixedDepth(k) if k else FixedDepth(max(engine_ks), max_batch=0)
            s = eng.generate(reqs).stats
            it = max(s.target_forwards, 1)
            pts.append({"B": B, "k": k, "draft_s": s.draft_s / it, "other_s": s.other_s / it})
        log(f"engine with drafter {drafter.name} at batch {B}: k = {list(engine_ks)}")
    return pts, reqs


PROFILE_PROMPTS_SEED = 3
"""Seed of the math prompts a hardware profile is measured on (CLI and training alike)."""


def profile(
    model: Transformer,
    drafter: Drafter | None,
    prompts: list[list[int]],
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
    qs: tuple[int, ...] = (1, 2, 4, 8),
    ctxs: tuple[int, ...] = (64, 256, 1024),
    engine_batches: tuple[int, ...] = (1, 4, 16, 32),
    engine_ks: tuple[int, ...] = (0, 1, 3, 5),
    tree_nodes: tuple[int, ...] = (2, 4, 8, 16),
    new_tokens: int = 32,
    repeats: int = 5,
    log: Callable[[str], None] = print,
) -> CostModel:
    """Measure and fit; `prompts` (token ids) feed the engine runs (and a drafter of trees
    gets the tree terms: `tree_terms`)."""
    points = []
    p = next(model.parameters())
    ctxs = tuple(c for c in ctxs if c + max(qs) <= model.cfg.max_position_embeddings)
    for B in batches:
        cache = KVCache(model.cfg, B, max(ctxs) + max(qs), dtype=p.dtype, device=p.device)
        for ctx in ctxs:
            for q in qs:
                s = time_forward(model, B, q, ctx, repeats, cache)
                points.append({"B": B, "q": q, "ctx": ctx, "seconds": s})
        del cache
        log(f"target forward at batch {B}: {len(points)} points")
    coef, err = fit_target(points)
    cm = CostModel(**coef)
    engine_pts, tree_pts = [], None
    if drafter is not None:
        engine_pts, reqs = _engine_points(
            model, drafter, prompts, engine_batches, engine_ks, new_tokens, log
        )
        drafting = [p for p in engine_pts if p["k"] > 0]  # k = 0 only stores features
        feats = [[1.0, p["B"], p["k"], p["k"] * p["B"]] for p in drafting]
        d, d_err = fit_features(feats, [p["draft_s"] for p in drafting])
        o0, o1, o_err = fit_linear(
            [p["B"] * (p["k"] + 1) for p in engine_pts], [p["other_s"] for p in engine_pts]
        )
        cm.draft_fixed, cm.draft_per_row, cm.draft_step, cm.draft_step_per_row = d
        cm.overhead_fixed, cm.overhead_per_token = o0, o1
        err.update(draft_mape=round(d_err, 4), overhead_mape=round(o_err, 4))
        if drafter.tree:
            ctx = statistics.mean(len(r.prompt_ids) for r in reqs)  # the timed rows'
            cm.tree_fixed, cm.tree_per_token, tree_pts, t_err = tree_terms(
                model, cm, reqs, engine_batches, tree_nodes, ctx + new_tokens / 2
            )
            err.update(tree_mape=round(t_err, 4))
            log(f"tree verification at batches {list(engine_batches)}: n = {list(tree_nodes)}")
    cm.meta = {
        "format": FORMAT,
        "threads": torch.get_num_threads(),
        "device": str(next(model.parameters()).device),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "fit_error": err,
        "target_points": points,
        "engine_points": engine_pts,
        "tree_points": tree_pts,
        "drafter": None if drafter is None else drafter.name,
    }
    return cm


QUICK = dict(
    batches=(1, 16),
    qs=(1, 4),
    ctxs=(64, 256),
    engine_batches=(1, 8),
    engine_ks=(0, 1, 3),
    tree_nodes=(4,),
    new_tokens=6,
    repeats=1,
)
"""The grid of `quick_profile`: eight forwards (each after a warm-up) and a few short engine
runs (batch 4 dropped: 0.4 s of a 5 s budget, and the fit is corrected online anyway)."""
QUICK_PROMPT = 16
"""Tokens of each prompt `quick_profile`'s engine runs keep (the last ones)."""


MEASURE = "measure"
"""`cached_profile`'s path (and `rollout.profile`) that asks for the full profile."""


def quick_profile(
    model: Transformer,
    drafter: Drafter,
    prompts: list[list[int]],
    log: Callable[[str], None] = print,
) -> CostModel:
    """A coarse profile measured in seconds, the prior of adaptive depth when no full
    profile is cached: its errors are what the online calibration (`engine.calibration`)
    corrects from the engine's own iterations, so a run starts at once instead of
    spending minutes measuring first. Never cached, never marked stale."""
    t0 = time.perf_counter()
    log(
        "a quick hardware profile for adaptive depth: measuring (seconds; longer on a busy machine)"
    )
    # its stages as they end: a loaded machine takes minutes, never in silence
    # short prompts: an iteration's draft and bookkeeping cost does not depend on the
    # prompt, and prefilling long ones would be most of the engine runs' time
    short = [p[-QUICK_PROMPT:] for p in prompts]
    cm = profile(model, drafter, short, log=lambda m: log(f"quick profile: {m}"), **QUICK)
    cm.meta["quick"] = True
    log(f"a quick hardware profile for adaptive depth in {time.perf_counter() - t0:.1f} s")
    return cm


def cached_profile(
    model: Transformer,
    drafter: Drafter,
    prompts: list[list[int]],
    path: str | Path = "",
    log: Callable[[str], None] = print,
) -> CostModel:
    """The hardware profile of `model` + `drafter` on this machine, as `path` says (the
    values of `rollout.profile`): a profile JSON; '' = the cached one under
    $SPECROLL_HOME/profiles, else a `quick_profile` (seconds, not cached); `MEASURE` = the
    cached one, else the full profile measured now (minutes) and cached.

    The cache key is the model shape, the drafter, the thread count and (when not the
    fp32 CPU default) the device and dtype: a profile taken with other threads, another
    model, on another device or in another dtype would choose depths for the wrong machine.

    A cached profile is measured again when it is of an older format or was marked
    stale: `AdaptiveDepth` compares it with the iteration times the engine measures and,
    when they disagree by more than its `stale_band` (the machine was busy while it was
    measured, or has changed since), marks the file (`CostModel.mark_stale`). Re-measuring
    takes minutes, so it happens here (with `MEASURE`), at the start of the next run,
    never in the middle of a rollout; the run that found the disagreement corrects the
    profile online. A stale profile without `MEASURE` gives way to a quick one."""
    measure = path == MEASURE
    if path and not measure:
        return CostModel.load(path, "rollout.profile")
    from specroll.model.hub import home

    c = model.cfg
    key = f"{c.num_layers}x{c.hidden_size}-v{c.vocab_size}-t{torch.get_num_threads()}"
    p = next(model.parameters())
    if p.device.type != "cpu":
        name = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else ""
        key += f"-{p.device.type}-{name.replace(' ', '_')}".rstrip("-")
    if p.dtype != torch.float32:
        key += f"-{str(p.dtype).removeprefix('torch.')}"
    cached = home() / "profiles" / f"{key}-{drafter.name}.json"
    cm = _usable(cached, drafter, log) if cached.exists() else None
    if cm is not None:
        cm.meta["cache_path"] = str(cached)
        return cm
    if not measure:
        return quick_profile(model, drafter, prompts, log)
    log(f"measuring a hardware profile for adaptive depth (once; saved to {cached})")
    cm = profile(model, drafter, prompts, log=log)
    cached.parent.mkdir(parents=True, exist_ok=True)
    cm.save(cached)
    cm.meta["cache_path"] = str(cached)
    return cm


def _usable(cached: Path, drafter: Drafter, log: Callable[[str], None]) -> CostModel | None:
    """The cached profile, or None (saying why) when it is damaged (then removed), of an
    older format, without the tree terms `drafter` needs, or marked stale."""
    try:
        cm = CostModel.load(cached, "cached profile")
    except ValueError as e:  # damaged (cut short, edited): measured again, never used
        log(f"{e}: not used, removed")
        with contextlib.suppress(OSError):
            cached.unlink()
        return None
    if cm.meta.get("format") != FORMAT:
        log(f"{cached} was measured for an older cost model: not used")
    elif drafter.tree and cm.meta.get("tree_points") is None:
        log(f"{cached} has no tree verification terms: not used")
    elif cm.meta.get("stale"):
        log(f"{cached} disagreed with measured iteration times ({cm.meta['stale']}): not used")
    else:
        return cm
    return None
