"""Engine benchmark: specroll vs transformers `generate`, and the cost of verification.

Both engines run in this process on the same prompts, interleaved, and each point is the
median of several runs (the machine is shared and noisy). `verify_cost` is the time of
one engine forward adding q tokens to every row over the time adding one: the number
speculative decoding lives on. Timings synchronise the model's device around each call
(`specroll.device.synchronize`), so GPU figures time the kernels, not their launch; every
report records the device and dtype it ran in.

Run it: `specroll bench engine --json`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from specroll.device import synchronize
from specroll.drafters.base import Drafter
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.prompts import BUILTIN_PROMPTS
from specroll.engine.request import Request, SamplingParams
from specroll.inputs import regular_entries
from specroll.model.kv_cache import KVCache
from specroll.model.transformer import Transformer
from specroll.spec.metrics import SpecStats


def median_time(
    repeats: int,
    fn: Callable[..., object],
    *args,
    device: torch.device | None = None,
    **kwargs,
) -> float:
    """Median wall time of fn(*args, **kwargs) over `repeats` calls; with `device`, each
    call is timed from and to an idle device (GPU work is asynchronous)."""
    times = []
    for _ in range(repeats):
        if device is not None:
            synchronize(device)
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        if device is not None:
            synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def placement(model: torch.nn.Module) -> dict[str, str]:
    """{"device": ..., "dtype": ...} of a model's weights, for benchmark reports."""
    p = next(model.parameters())
    return {"device": str(p.device), "dtype": str(p.dtype).removeprefix("torch.")}


def _hf_model(model_dir: str, device: torch.device, dtype: torch.dtype):
    # transformers' sdpa path copies the KV cache per layer under a mask unless told to use
    # native GQA; give the baseline its best setting
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    from transformers import AutoModelForCausalLM

    regular_entries(model_dir, "model directory")  # no FIFO for a native reader to wait on
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=False)
    return hf.to(device).eval()


def _hf_generate(hf, tok, prompts: list[list[int]], new_tokens: int) -> int:
    width = max(len(p) for p in prompts)
    pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else 0
    dev = hf.device
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)  # left pad
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
        )
    return (out.shape[1] - width) * len(prompts)


def verify_cost(
    model: Transformer,
    batches: list[int],
    qs: tuple[int, ...] = (1, 2, 4, 8),
    context: int = 128,
    repeats: int = 9,
) -> list[dict]:
    """time(forward adding q tokens per row) / time(adding 1), rows at `context` tokens.

    The q values are measured round-robin within each repeat, so a change in machine load
    hits numerator and denominator alike; each ratio is the median of per-round ratios.
    """
    rows = []
    p = next(model.parameters())
    dev, V = p.device, model.cfg.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)  # the same tokens on every device

    def ids(shape: tuple[int, int]) -> torch.Tensor:
        return torch.randint(0, V, shape, generator=g, device="cpu").to(dev)

    for B in batches:
        cache = KVCache(model.cfg, B, context + max(qs), dtype=p.dtype, device=dev)
        start = torch.full((B,), context, dtype=torch.long, device=dev)
        toks = {q: ids((B, q)) for q in qs}
        with torch.inference_mode():
            prompt = ids((B, context))
            model(prompt, positions=torch.zeros(B, dtype=torch.long, device=dev), cache=cache)
            for q in qs:  # warm-up
                model(toks[q], positions=start, cache=cache)
            times: dict[int, list[float]] = {q: [] for q in qs}
            for _ in range(repeats):
                for q in qs:
                    t = median_time(1, model, toks[q], positions=start, cache=cache, device=dev)
                    times[q].append(t)
        for q in qs:
            ratios = [t / t1 for t, t1 in zip(times[q], times[1], strict=True)]
            rows.append(
                {
                    "batch": B,
                    "q": q,
                    "ratio": round(statistics.median(ratios), 3),
                    "ms": round(statistics.median(times[q]) * 1e3, 3),
                }
            )
    return rows


def bench_engine(
    model: Transformer,
    tok,
    model_name: str,
    batches: list[int],
    new_tokens: int = 128,
    repeats: int = 3,
    hf: bool = True,
    verify_batches: list[int] | None = None,
    log: Callable[[str], None] = print,
    cuda_graphs: bool = False,
) -> dict:
    """Throughput of specroll and transformers at each batch size, plus verify_cost;
    `cuda_graphs`: the engine's decoding step replayed as CUDA graphs (`engine.graphs`)."""
    from specroll.model.hub import resolve

    p = next(model.parameters())
    hf_model = _hf_model(str(resolve(model_name)), p.device, p.dtype) if hf else None
    rows = []
    for B in batches:
        texts = [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(B)]
        prompts = [tok.encode_prompt(t) for t in texts]
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=())
        engine = Engine(model, EngineConfig(max_batch=B, cuda_graphs=cuda_graphs))
        reqs = [Request(p, params) for p in prompts]
        engine.generate(reqs[:1])  # warm-up (allocates the cache)
        ours, theirs = [], []
        for _ in range(repeats):  # interleave so drift in machine load hits both alike
            ours.append(median_time(1, engine.generate, reqs, device=p.device))
            if hf_model is not None:
                args = (hf_model, tok, prompts, new_tokens)
                theirs.append(median_time(1, _hf_generate, *args, device=p.device))
        row = {"batch": B, "specroll_tok_s": round(B * new_tokens / statistics.median(ours), 2)}
        if theirs:
            row["hf_tok_s"] = round(B * new_tokens / statistics.median(theirs), 2)
            row["ratio"] = round(row["specroll_tok_s"] / row["hf_tok_s"], 3)
        log(f"batch {B}: {row}")
        rows.append(row)
    vc = verify_cost(model, verify_batches or [1, 4, 16, 64])
    return {
        "bench": "engine",
        "model": model_name,
        "config": placement(model),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "verify_cost": vc,
    }


def compare_spec(
    model: Transformer,
    reqs: list[Request],
    drafters: dict[str, Drafter] | dict[tuple[str, int], Drafter],
    batch: int,
    ks: list[int] | None,
    repeats: int = 3,
    log: Callable[[str], None] = print,
    cuda_graphs: bool = False,
) -> list[dict]:
    """Speculative vs plain decoding of `reqs` with `batch` slots, in this process
    (`cuda_graphs`: every engine's decoding step replayed as CUDA graphs).

    `drafters` by name, each run at every k of `ks`; or, with `ks` None, by (name, k),
    one drafter per engine (a drafter that keeps history must not share it with another
    engine: within a round they sample with the same seeds).
    Every (drafter, k) engine and the plain one run the same requests, interleaved, and
    each point is the median of `repeats` rounds. Speculative sampling draws the plain
    engine's distribution, not its samples: with stop tokens the modes emit different
    numbers of tokens, so each run is scored by its own tokens per second, and the
    speed-up is the median of per-round ratios to the plain run of the same round.
    overhead_frac is the share of wall time outside the draft and target forwards
    (verification, sampling, bookkeeping).
    """
    plain, engines = _spec_engines(model, reqs, drafters, batch, ks, cuda_graphs)
    tok_s, stats = _interleaved_rounds(plain, engines, reqs, repeats)
    rows = []
    for d, k in engines:
        row = _spec_row(d, k, batch, stats[(d, k)], tok_s[(d, k)], tok_s[None])
        log(f"{row}")
        rows.append(row)
    return rows


def _spec_engines(
    model: Transformer,
    reqs: list[Request],
    drafters: dict[str, Drafter] | dict[tuple[str, int], Drafter],
    batch: int,
    ks: list[int] | None,
    cuda_graphs: bool = False,
) -> tuple[Engine, dict[tuple[str, int], Engine]]:
    """`compare_spec`'s plain engine (warmed up on one request) and its engine per
    (drafter, k), all with `batch` slots."""
    from specroll.engine.depth import FixedDepth

    config = EngineConfig(max_batch=batch, cuda_graphs=cuda_graphs)
    plain = Engine(model, config)
    plain.generate(reqs[:1])  # warm-up
    runs = (
        drafters if ks is None else {(d, k): drafter for d, drafter in drafters.items() for k in ks}
    )
    engines = {
        (d, k): Engine(model, config, drafter, FixedDepth(k)) for (d, k), drafter in runs.items()
    }
    return plain, engines


def _interleaved_rounds(
    plain: Engine, engines: dict[tuple[str, int], Engine], reqs: list[Request], repeats: int
) -> tuple[dict, dict]:
    """`repeats` rounds of the plain engine, then every speculative one, on the same
    freshly seeded requests; returns each engine's tokens per second and `SpecStats` per
    round, keyed by (drafter, k) (None: the plain engine)."""
    tok_s: dict = {key: [] for key in [None, *engines]}
    stats: dict = {}

    def run(key, eng: Engine, reqs: list[Request]) -> None:
        synchronize(eng.device)
        t0 = time.perf_counter()
        out = eng.generate(reqs)
        synchronize(eng.device)
        tok_s[key].append(sum(len(r.token_ids) for r in out) / (time.perf_counter() - t0))
        stats.setdefault(key, []).append(out.stats)

    for r in range(repeats):
        # fresh seeds every round: a drafter that remembers earlier rounds (history) must
        # not meet the very samples it saw before
        reqs_r = [_reseeded(q, r * len(reqs)) for q in reqs]
        run(None, plain, reqs_r)
        for key, eng in engines.items():
            run(key, eng, reqs_r)
    return tok_s, stats


def _spec_row(
    d: str, k: int, batch: int, ss: list[SpecStats], spec_tok_s: list[float], ar_tok_s: list[float]
) -> dict:
    """One (drafter, k) line of `compare_spec`: medians over its rounds `ss` (SpecStats)
    and its speed-up over the plain runs of the same rounds."""
    ratios = [s / a for s, a in zip(spec_tok_s, ar_tok_s, strict=True)]

    def med(of: Callable[[SpecStats], float], digits: int) -> float:
        """The median over the rounds of one figure of their SpecStats, rounded."""
        return round(statistics.median(of(s) for s in ss), digits)

    return {
        "drafter": d,
        "batch": batch,
        "k": k,
        "acceptance_length": med(lambda s: s.acceptance_length, 3),
        "per_position": [round(x, 4) for x in ss[-1].per_position],
        "tokens_per_target_forward": med(lambda s: s.tokens_per_target_forward, 3),
        "ar_tok_s": round(statistics.median(ar_tok_s), 2),
        "spec_tok_s": round(statistics.median(spec_tok_s), 2),
        "speedup": round(statistics.median(ratios), 3),
        "overhead_frac": med(lambda s: s.other_s / s.total_s, 4),
        "draft_frac": med(lambda s: s.draft_s / s.total_s, 4),
        "draft_ms_per_iter": med(lambda s: 1e3 * s.draft_s / max(s.target_forwards, 1), 3),
        "nodes_per_row": med(lambda s: s.draft_nodes / max(s.row_forwards, 1), 2),
        "target_ms_per_iter": med(lambda s: 1e3 * s.target_s / max(s.target_forwards, 1), 3),
        # what every smaller budget would have emitted (exact for trees: SpecStats.tau_at)
        "tau_at": {
            m: round(statistics.median(s.tau_at(m) for s in ss), 3)
            for m in sorted({1, 2, 4, 8, 16, 32, 64, k})
            if m <= k
        },
    }


def _reseeded(req: Request, offset: int) -> Request:
    """`req` with its seed moved by `offset` (unseeded requests stay unseeded)."""
    if req.params.seed is None or offset == 0:
        return req
    return Request(req.prompt_ids, replace(req.params, seed=req.params.seed + offset))


def spec_requests(
    tok, B: int, new_tokens: int, temperature: float, group: int = 0, seed: int = 0
) -> list[Request]:
    """`bench spec`'s B requests: with `group` = 0, the built-in prompts, exactly
    `new_tokens` tokens each (stop tokens off); else ceil(B / group) procedural math
    prompts, each `group` times (a GRPO group), ending at EOS as RL rollouts do."""
    if group <= 0:
        texts = [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(B)]
        ids = [tok.encode_prompt(t) for t in texts]
        stops: tuple[int, ...] | None = ()
    else:
        from specroll.tasks.sets import encode, prompt_set

        prompts = [encode(tok, p) for p in prompt_set("math", -(-B // group), seed=1)]
        ids = [prompts[i // group] for i in range(B)]
        stops = None
    return [
        Request(
            p,
            SamplingParams(
                temperature, max_new_tokens=new_tokens, stop_token_ids=stops, seed=seed + i
            ),
        )
        for i, p in enumerate(ids)
    ]


def remember_past(model: Transformer, drafter: Drafter, reqs: list[Request], epochs: int) -> None:
    """Give a history drafter `epochs` earlier rollouts of every request (plain samples
    with seeds of their own), as RL's past epochs would; other drafters ignore it."""
    remember = getattr(drafter, "remember", None)
    if remember is None or epochs <= 0:
        return
    plain = Engine(model, EngineConfig(max_batch=max(len(reqs), 1)))
    for e in range(epochs):
        for r in plain.generate([_reseeded(q, (1 + e) * 10**9) for q in reqs]):
            remember(r.prompt_ids, r.token_ids)


def bench_spec(
    model: Transformer,
    tok,
    drafters: list[str],
    batches: list[int],
    ks: list[int],
    build: Callable[[str, Transformer], Drafter],
    new_tokens: int = 128,
    repeats: int = 3,
    temperature: float = 1.0,
    log: Callable[[str], None] = print,
    group: int = 0,
    past: int = 1,
    cuda_graphs: bool = False,
) -> dict:
    """`compare_spec` per batch size on `spec_requests` (group 0: built-in prompts, else
    GRPO groups of math prompts), one drafter per (drafter, k) engine; history drafters
    start with `past` earlier epochs. A drafter spec may name its own depth or node
    budget as `SPEC@K` (e.g. `eagle3:drafts/math@3,history@16`); others run at `ks`.
    `build(spec, model)` makes a drafter (`drafting.registry.build`), afresh per batch."""
    combos = []
    for d in drafters:
        spec, at, k = d.rpartition("@") if "@" in d else (d, "", "")
        combos += [(spec, int(k))] if at else [(d, k_) for k_ in ks]
    rows = []
    for B in batches:
        reqs = spec_requests(tok, B, new_tokens, temperature, group)
        built = {(d, k): build(d, model) for d, k in combos}
        for drafter in built.values():
            remember_past(model, drafter, reqs, past)
        rows += compare_spec(model, reqs, built, B, None, repeats, log, cuda_graphs)
    return {
        "bench": "spec",
        "config": placement(model),
        "new_tokens": new_tokens,
        "temperature": temperature,
        "group": group,
        "past_epochs": past,
        "cuda_graphs": cuda_graphs,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
