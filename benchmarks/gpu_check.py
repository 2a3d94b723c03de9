"""The engine's GPU check in one command: decode iteration times against plain decoding,
transformers and the HBM floor, plus the GPU chi-square tests, within an 8-minute slot.

    PYTHONPATH=. python benchmarks/gpu_check.py              # one H100/H200: ~7 minutes
    PYTHONPATH=. python benchmarks/gpu_check.py --device cpu # dry run: tiny shapes, seconds

(`PYTHONPATH=.` from the repository's root: where specroll is not installed, as on a bare
GPU machine.)

In order of importance (past `--budget-s` the rest is skipped and listed as skipped):
1. ms per decode iteration (a generate of N tokens minus one of 1 token, over
   `stats.target_forwards`; configurations interleaved; median of repeats), graphs off
   and on (`engine.graphs`; captured in the warm-up call, replayed in the timed ones), of
   the modes the issue's targets name (plain, EAGLE-3 chain of 3 with a random head, a
   random tree of 16): SmolLM2-135M's shape at every batch, Qwen3-8B's at batch <= 32;
2. `pytest -m gpu -k joint tests/test_gpu.py`: the chi-square exactness tests, eager and
   with graphs (`--gpu-tests-k ''` runs the whole file);
3. the anchor: transformers' generate with its static cache and torch.compile, same
   shapes, batches and measurement (N tokens minus 1, over N - 1);
4. the simulator's tree inputs (trees of 4, random chains of 4 and 16) at Qwen3-8B's
   shape, then every other mode (chains of 1 and 5, trees of 64) and batch, Qwen3-1.7B
   and its anchor.
The dry run (`--device cpu`) takes the graph path's CPU stand-in (`graphs.CAPTURE_ON`).
Weights are random (a forward's time does not depend on them), made on the device in the
run's dtype. A shape's HBM floor is the weight bytes a decode iteration reads over a
measured device-to-device copy rate. A failing row (out of memory, the graph path) is
recorded, never fatal.

Output: a `row {...}` line per measured row, then as the last line one JSON object: the
configuration, `rows` (shape, batch, mode, graphs, ms_per_iter, vs_plain), `anchor`,
`floors`, `gpu_tests`, `targets` (the issue's, as {measured, target, met} where
measured), `skipped` and `errors`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specroll.device import (
    check_device_name,
    check_dtype_name,
    resolve_device,
    resolve_dtype,
    synchronize,
)
from specroll.drafters.eagle3 import Eagle3Drafter
from specroll.drafting.eagle3_head import Eagle3Config, Eagle3Head
from specroll.engine import Engine, EngineConfig, Request, SamplingParams, graphs
from specroll.engine.depth import FixedDepth
from specroll.engine.profile import RandomTree
from specroll.model import ModelConfig, Transformer
from specroll.model.weights import for_inference

sys.path.insert(0, str(Path(__file__).parent))
from bench_io import Parser, output  # noqa: E402

HF_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
             "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
             "tie_word_embeddings", "rope_theta", "max_position_embeddings")  # fmt: skip


def shape(name: str, *values: object) -> tuple[str, dict[str, Any]]:
    """(name, a config.json dict of HF_FIELDS): transformers and `ModelConfig.from_hf` read it."""
    hf = dict(zip(HF_FIELDS, values, strict=True))
    return name, hf | {"rms_norm_eps": 1e-5 if hf["model_type"] == "llama" else 1e-6}


SHAPES = {  # role -> (name, HF config); "small" and "big" carry the targets
    "cuda": {
        "small": shape("smollm2-135m", "llama", 30, 576, 1536, 9, 3, 64, 49152, True, 1e5, 8192),
        "big": shape("qwen3-8b", "qwen3", 36, 4096, 12288, 32, 8, 128, 151936, False, 1e6, 40960),
        "mid": shape("qwen3-1.7b", "qwen3", 28, 2048, 6144, 16, 8, 128, 151936, True, 1e6, 40960),
    },
    "cpu": {  # benchmarks/host_syncs.py's tiny model, and Qwen3 (qk-norm) versions of it
        "small": shape("tiny-llama", "llama", 4, 32, 64, 4, 2, 8, 64, True, 1e4, 256),
        "big": shape("tiny-qwen3-untied", "qwen3", 4, 32, 64, 4, 2, 8, 64, False, 1e4, 256),
        "mid": shape("tiny-qwen3", "qwen3", 4, 32, 64, 4, 2, 8, 64, True, 1e4, 256),
    },
}
DEFAULTS = {  # per device type; every one a flag
    "cuda": dict(batches="1,8,32,128", chains="1,3,5", trees="4,16,64", rchains="4,16",
                 new_tokens=24, prompt_len=128, repeats=3, budget_s=420.0, dtype="bfloat16",
                 copy_mib=1024),
    "cpu": dict(batches="1,2", chains="1,3", trees="4,16", rchains="4,16", new_tokens=6,
                prompt_len=8, repeats=1, budget_s=600.0, dtype="float32", copy_mib=16),
}  # fmt: skip
TARGETS = ("plain", "chain3", "tree16")
"""The modes the issue's targets name: measured first (the big shape at batch <= 32)."""
SIM = ("tree4", "rchain4", "rchain16")
"""With tree16, the simulator's tree inputs (`specroll.sim.measured.gpu_costs`): next."""
RESERVE_S = 15.0
"""Budget kept for the final report; a step starts only with more left than its need."""
GRACE_S = 30.0
"""Past budget + grace, a step in flight is interrupted (the final line still comes)."""
STUCK_S = 15.0
"""Past budget + grace + this, a main thread stuck in a call that never returns to Python
(a hung CUDA call) is given up: a watchdog thread prints the report and exits."""


class Deadline(BaseException):
    """The hard deadline: raised by SIGALRM in whatever runs, caught only by `main`."""


def _alarm(signum: int, frame: object) -> None:
    raise Deadline


def _watchdog(check: Check) -> None:
    check.skipped.append({"step": "(run)", "reason": "stuck past the deadline: watchdog exit"})
    print(json.dumps(check.report()), flush=True)
    os._exit(3)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:300]}"


def random_target(hf: dict[str, Any], dev: torch.device, dtype: torch.dtype) -> Transformer:
    """A Transformer of the HF config's shape, built on `dev` in `dtype` (an 8B model is
    never materialised in fp32 or on the host), normal(0, 0.02) with norms at one."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with dev:
            model = Transformer(ModelConfig.from_hf(hf))  # RoPE tables stay fp32
    finally:
        torch.set_default_dtype(before)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=g)
    return for_inference(model, dev, dtype)


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of weights a decode iteration reads: every matrix and the LM head; an untied
    input embedding is only gathered row by row, so it is left out."""
    untied = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return (cfg.num_params() - untied) * dtype.itemsize


def copy_rate(dev: torch.device, mib: int, reps: int = 20) -> float:
    """Bytes per second a device-to-device copy moves, counting bytes read and written."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    synchronize(dev)
    return 2 * src.numel() * reps / (time.perf_counter() - t0)


def hf_model(hf: dict[str, Any], dev: torch.device, dtype: torch.dtype, recipe: str):
    """transformers' model of the same shape, random, with a static cache; on a GPU with
    torch.compile: 'auto' lets generate compile its decode step (transformers 5.x does so
    for static caches: CompileConfig, reduce-overhead), 'forward' is the docs' recipe
    (model.forward compiled, reduce-overhead, fullgraph; generate's own compile off)."""
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")  # native GQA: its best path
    from transformers import AutoConfig, AutoModelForCausalLM, CompileConfig

    fields = dict(hf)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with dev:  # weights made and initialised on the device
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to(dev, dtype).eval()
    gen = model.generation_config
    gen.cache_implementation = "static"
    if dev.type != "cuda":
        gen.disable_compile = True  # a dry run spends no time compiling
    elif recipe == "forward":
        gen.disable_compile = True
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    else:
        gen.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    return model


def dynamo_counts() -> dict[str, int]:
    """torch.compile's graphs and graph breaks so far (a recompile is a graph more)."""
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    return {"graphs": int(counters["stats"].get("unique_graphs", 0)), "graph_breaks": breaks}


def engine(model: Transformer, head: Eagle3Head | None, mode: str, cfg: EngineConfig) -> Engine:
    """plain; chainK: the EAGLE-3 head drafting K tokens; treeN: random trees of N nodes;
    rchainN: random chains of N tokens (what a tree of N nodes costs over a chain of its
    width: the simulator's tree inputs, `specroll.sim.measured.gpu_costs`)."""
    if mode == "plain":
        return Engine(model, cfg)
    n = int(mode.removeprefix("rchain").removeprefix("chain").removeprefix("tree"))
    if mode.startswith("chain"):
        return Engine(model, cfg, Eagle3Drafter(head), FixedDepth(n))
    chain = mode.startswith("rchain")
    return Engine(model, cfg, RandomTree(model.cfg.vocab_size, chain=chain), FixedDepth(n))


class Check:
    """One run of the check: settings, the model in hand, and everything measured."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.start = args, time.monotonic()
        self.dev, self.dtype = resolve_device(args.device), resolve_dtype(args.dtype)
        self.shapes = SHAPES["cuda" if self.dev.type == "cuda" else "cpu"]
        self.batches = [int(b) for b in args.batches.split(",")]
        self.modes = ["plain"] + [f"chain{k}" for k in args.chains.split(",") if k]
        self.modes += [f"tree{n}" for n in args.trees.split(",") if n]
        self.modes += [f"rchain{n}" for n in args.rchains.split(",") if n]
        self.rows: list[dict[str, Any]] = []
        self.anchor: list[dict[str, Any]] = []
        self.compiled: dict[str, dict[str, int]] = {}
        self.floors: dict[str, dict[str, float]] = {}
        self.gpu_tests: dict[str, Any] | None = None
        self.skipped: list[dict[str, str]] = []
        self.errors: list[dict[str, str]] = []
        self.held: tuple[str, Transformer, Eagle3Head | None] | None = None
        self.copy_bps = 0.0

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def free(self, models: bool = False) -> None:
        """Give unused memory back; `models`: drop the model in hand too (the next may be
        16 GB)."""
        if models:
            self.held = None
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def timed(self, run: Callable[[], int]) -> tuple[float, int]:
        synchronize(self.dev)
        t0 = time.perf_counter()
        n = run()
        synchronize(self.dev)
        return time.perf_counter() - t0, n

    def emit(self, table: list[dict[str, Any]], row: dict[str, Any]) -> None:
        table.append(row)
        print("row", json.dumps(row), flush=True)

    # ---------------------------------------------------------------- the engine

    def target(self, role: str, head: bool) -> tuple[Transformer, Eagle3Head | None]:
        """The role's policy (kept while in hand) and, when asked, its EAGLE-3 head: one
        target layer and a 32k draft vocabulary, made on the host, then placed."""
        if self.held is None or self.held[0] != role:
            self.free(models=True)
            name, hf = self.shapes[role]
            model = random_target(hf, self.dev, self.dtype)
            nbytes = weight_bytes(model.cfg, self.dtype)
            self.floors[name] = {"weight_bytes": nbytes, "floor_ms": nbytes / self.copy_bps * 1e3}
            self.held = (role, model, None)
        role, model, eagle = self.held
        if head and eagle is None:
            cfg = Eagle3Config.for_target(model.cfg, min(32000, model.cfg.vocab_size))
            eagle = Eagle3Head(cfg).init_weights(3, 0.02).set_embedding(model)
            self.held = (role, model, for_inference(eagle, self.dev, self.dtype))
        return self.held[1], self.held[2]

    def requests(self, vocab: int, batch: int, new_tokens: int) -> list[Request]:
        g, n = torch.Generator().manual_seed(1), self.args.prompt_len
        params = [SamplingParams(1.0, max_new_tokens=new_tokens, stop_token_ids=(), seed=i)
                  for i in range(batch)]  # fmt: skip
        return [Request(torch.randint(0, vocab, (n,), generator=g).tolist(), p) for p in params]

    def add_row(self, row: dict[str, Any]) -> None:
        """A row, with its ratio to plain decoding at the same (shape, batch, graphs) and a
        plain row's to the HBM floor."""
        ms, same = row["ms_per_iter"], ("shape", "batch", "graphs")
        plain = [r["ms_per_iter"] for r in self.rows if r["mode"] == "plain" and r["ms_per_iter"]
                 and all(r[k] == row[k] for k in same)]  # fmt: skip
        if ms and plain:
            row["vs_plain"] = round(ms / plain[0], 3)
        if ms and row["mode"] == "plain":
            row["vs_floor"] = round(ms / self.floors[row["shape"]]["floor_ms"], 2)
        self.emit(self.rows, row)

    def engine_group(self, role: str, batch: int, modes: list[str]) -> None:
        """Every mode, graphs off and on, at one (shape, batch): interleaved, a row each."""
        name = self.shapes[role][0]
        model, head = self.target(role, any(m.startswith("chain") for m in modes))
        reqs = self.requests(model.cfg.vocab_size, batch, self.args.new_tokens)
        first = self.requests(model.cfg.vocab_size, batch, 1)  # the prefill, taken off
        engines: dict[tuple[str, bool], Engine] = {}
        times: dict[tuple[str, bool], list[float]] = {}
        forwards: dict[tuple[str, bool], int] = {}

        def run(eng: Engine, batch_reqs: list[Request]) -> int:
            return eng.generate(batch_reqs).stats.target_forwards

        def fail(key: tuple[str, bool], e: Exception) -> None:
            engines.pop(key, None)
            self.free()
            row = {"shape": name, "batch": batch, "mode": key[0], "graphs": key[1]}
            self.add_row(row | {"ms_per_iter": None, "error": _error(e)})

        for key in [(m, g) for m in modes for g in (False, True)]:
            try:
                cfg = EngineConfig(max_batch=batch, cuda_graphs=key[1])
                engines[key], times[key] = engine(model, head, key[0], cfg), []
                run(engines[key], reqs)  # warm-up: kernels, caches, allocator
            except Exception as e:
                fail(key, e)
        for _ in range(self.args.repeats):
            for key, eng in list(engines.items()):
                try:
                    prefill, _ = self.timed(partial(run, eng, first))
                    total, forwards[key] = self.timed(partial(run, eng, reqs))
                    times[key].append((total - prefill) / max(forwards[key], 1))
                except Exception as e:
                    fail(key, e)
        for (mode, on), eng in engines.items():
            ms = round(statistics.median(times[mode, on]) * 1e3, 4)
            row = {"shape": name, "batch": batch, "mode": mode, "graphs": on}
            row |= {"ms_per_iter": ms, "forwards": forwards[mode, on]}
            # what the graph path reports of the last run, whatever its fields' names
            graph = {k: v for k, v in vars(eng.stats).items() if "graph" in k or "capture" in k}
            if eng.captured is not None and eng.captured.failed:  # why, for the report
                graph["failed"] = sorted(set(eng.captured.failed.values()))[:3]
            self.add_row(row | {"graph_stats": graph})
        engines.clear()
        self.free()

    # ---------------------------------------------------------------- the anchor

    def hf_anchor(self, role: str) -> None:
        """transformers' generate at every batch, a row each; its compile counts after."""
        name, hf = self.shapes[role]
        self.free(models=True)
        model = hf_model(hf, self.dev, self.dtype, self.args.hf_compile)
        before = dynamo_counts()
        try:
            for batch in self.batches:
                if self.left() < RESERVE_S + 10:
                    self.skipped.append({"step": f"anchor {name} b{batch}", "reason": "budget"})
                    continue
                row = {"shape": name, "batch": batch, "mode": "transformers"}
                try:
                    row |= self.hf_times(model, hf["vocab_size"], batch)
                except Exception as e:
                    row |= {"ms_per_iter": None, "error": _error(e)}
                    self.free()
                self.emit(self.anchor, row)
        finally:
            after = dynamo_counts()
            counts = {k: after[k] - before[k] for k in after}
            self.compiled[name] = counts
            del model
            if self.dev.type == "cuda":
                torch._dynamo.reset()  # and with it its CUDA graphs' memory
            self.free()

    def hf_times(self, model: Any, vocab: int, batch: int) -> dict[str, float]:
        """ms per decode step: generate(N tokens) - generate(1 token), over N - 1."""
        a = self.args
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (batch, a.prompt_len), generator=g).to(self.dev)
        # sampling at T = 1 with no filter, as the engine's requests; exactly n tokens
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=0,
                      do_sample=True, temperature=1.0, top_k=0, top_p=1.0)  # fmt: skip

        def generate(n: int) -> int:
            with torch.inference_mode():
                model.generate(max_new_tokens=n, min_new_tokens=n, **kwargs)
            return n

        warm, _ = self.timed(partial(generate, a.new_tokens))  # compiles
        generate(1)
        generate(a.new_tokens)  # reduce-overhead's graphs recorded by now
        times = []
        for _ in range(a.repeats):
            prefill, _ = self.timed(partial(generate, 1))
            total, _ = self.timed(partial(generate, a.new_tokens))
            times.append((total - prefill) / max(a.new_tokens - 1, 1))
        return {"ms_per_iter": round(statistics.median(times) * 1e3, 4), "warmup_s": round(warm, 2)}

    # ---------------------------------------------------------------- the GPU tests

    def run_gpu_tests(self) -> None:
        """`pytest -m gpu -v tests/test_gpu.py` in a subprocess, within the budget; each
        test's outcome read from its own line (so a timed-out run still counts), the
        chi-square tests (`*joint_distribution*`) apart."""
        self.free(models=True)
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider"]
        cmd += ["tests/test_gpu.py", "-k", self.args.gpu_tests_k or "test"]
        t0, timeout = time.perf_counter(), max(self.left() - RESERVE_S, 10.0)
        root = Path(__file__).resolve().parents[1]
        try:
            out = subprocess.run(cmd, cwd=root, capture_output=True, timeout=timeout)
            rc: int | str = out.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = e, f"timeout after {timeout:.0f} s"
        text = b"".join(x or b"" for x in (out.stdout, out.stderr)).decode(errors="replace")
        found = re.findall(r"::(\S+) (PASSED|FAILED|ERROR|SKIPPED)", text)
        every, chi2 = Counter(o for _, o in found), Counter(o for t, o in found if "joint" in t)
        self.gpu_tests = {
            "cmd": " ".join(["python"] + cmd[1:]),
            "rc": rc,
            "wall_s": round(time.perf_counter() - t0, 1),
            **{k.lower(): every[k] for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")},
            "chi2": {k.lower(): chi2[k] for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")},
            "failures": [t for t, o in found if o in ("FAILED", "ERROR")],
            "tail": text[-3000:] if rc != 0 else "",
        }

    # ---------------------------------------------------------------- plan and report

    def plan(self) -> list[tuple[str, float, Callable[[], None]]]:
        """(label, seconds it needs to start, work), most important first."""
        cuda = self.dev.type == "cuda"
        steps: list[tuple[str, float, Callable[[], None]]] = []

        def engines(role: str, modes: list[str], batches: list[int]) -> None:
            for b in batches:
                label = f"engine {self.shapes[role][0]} b{b} {','.join(modes)}"
                steps.append((label, 10.0 * cuda, partial(self.engine_group, role, b, modes)))

        def anchor(role: str) -> None:  # torch.compile's first graphs take a minute
            label = f"anchor {self.shapes[role][0]}"
            steps.append((label, 90.0 * cuda, partial(self.hf_anchor, role)))

        targets = [m for m in self.modes if m in TARGETS]
        sim = [m for m in self.modes if m in SIM]
        rest = [m for m in self.modes if m not in TARGETS + SIM]
        upto32 = [b for b in self.batches if b <= 32]  # where the big shape's targets are
        engines("small", targets, self.batches)
        engines("big", targets, upto32)
        if cuda and not self.args.no_gpu_tests:
            steps.append(("gpu tests", 60.0, self.run_gpu_tests))
        anchor("small")
        anchor("big")
        engines("big", sim, upto32)
        engines("small", sim + rest, self.batches)
        engines("big", rest, upto32)
        engines("big", self.modes, [b for b in self.batches if b > 32])
        engines("mid", self.modes, self.batches)
        anchor("mid")
        return steps

    def run(self) -> None:
        self.copy_bps = copy_rate(self.dev, self.args.copy_mib)
        steps = self.plan()
        for i, (label, need, work) in enumerate(steps):
            if self.left() < need + RESERVE_S:
                self.skipped.append({"step": label, "reason": f"budget ({self.left():.0f} s left)"})
                continue
            try:
                work()
            except Deadline:
                self.skipped.append({"step": label, "reason": "interrupted at the deadline"})
                self.skipped += [{"step": s[0], "reason": "deadline"} for s in steps[i + 1 :]]
                return
            except Exception as e:
                self.errors.append({"step": label, "error": _error(e)})
                self.free(models=True)

    def targets(self) -> list[dict[str, Any]]:
        """The issue's targets, each where its rows were measured."""
        small, big = self.shapes["small"][0], self.shapes["big"][0]
        hf = {(r["shape"], r["batch"]): r.get("ms_per_iter") for r in self.anchor}
        out = []

        def add(name: str, r: dict[str, Any], measured: float, limit: float) -> None:
            met = measured <= limit if "<=" in name else measured < limit
            out.append({"name": name, **{k: r[k] for k in ("shape", "batch", "graphs")},
                        "measured": round(measured, 3), "target": limit, "met": met})  # fmt: skip

        for r in self.rows:
            ms, mode, b, shape = r["ms_per_iter"], r["mode"], r["batch"], r["shape"]
            if not ms:
                continue
            if mode == "plain" and b <= 32 and shape == small:
                add("plain ms <= 3 (small shape, batch 1-32)", r, ms, 3.0)
            if mode == "plain" and b <= 32 and shape == big:
                add("plain / HBM floor <= 1.5 (big shape, batch 1-32)", r, r["vs_floor"], 1.5)
            if mode == "tree16" and b == 32 and "vs_plain" in r:
                add("tree16 / plain <= 1.3 (batch 32)", r, r["vs_plain"], 1.3)
            if mode == "chain3" and b <= 32 and "vs_plain" in r:
                add("chain3 / plain <= 1.4 (batch 1-32)", r, r["vs_plain"], 1.4)
            if mode == "plain" and hf.get((shape, b)):
                add("plain / transformers < 1 (every batch)", r, ms / hf[shape, b], 1.0)
        return out

    def report(self) -> dict[str, Any]:
        import transformers

        a, cuda, targets = self.args, self.dev.type == "cuda", self.targets()
        failed = [{"step": f"{r['shape']} b{r['batch']} {r['mode']}", "error": r["error"]}
                  for r in self.rows + self.anchor if r.get("error")]  # fmt: skip
        config = {k: getattr(a, k) for k in ("dtype", "new_tokens", "prompt_len", "repeats",
                                             "budget_s", "hf_compile")}  # fmt: skip
        return {
            "bench": "gpu_check",
            "device": str(self.dev),
            "device_name": torch.cuda.get_device_name(self.dev) if cuda else platform.machine(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "config": config
            | {"batches": self.batches, "modes": self.modes, "graphs": [False, True]},
            "shapes": dict(self.shapes.values()),
            "copy_gb_s": round(self.copy_bps / 1e9, 1),
            "floors": self.floors,
            "rows": self.rows,
            "anchor": self.anchor,
            "anchor_compiled": self.compiled,
            "gpu_tests": self.gpu_tests,
            "targets": targets,
            "targets_met": f"{sum(t['met'] for t in targets)}/{len(targets)}",
            "skipped": self.skipped,
            "errors": self.errors + failed,
            "wall_s": round(time.monotonic() - self.start, 1),
        }


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (dry run)")
    ap.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--batches", help="comma-separated batch sizes")
    ap.add_argument("--chains", help="EAGLE-3 chain depths k")
    ap.add_argument("--trees", help="random tree sizes (nodes per row)")
    ap.add_argument("--rchains", help="random chain lengths (the simulator's tree inputs)")
    ap.add_argument("--new-tokens", type=int, help="N: tokens per request")
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--repeats", type=int, help="timed runs per configuration (median)")
    ap.add_argument("--budget-s", type=float, help="past it, steps not begun are skipped")
    ap.add_argument("--copy-mib", type=int, help="buffer of the copy-rate measurement")
    ap.add_argument("--hf-compile", choices=["auto", "forward"], default="auto")
    ap.add_argument("--no-gpu-tests", action="store_true")
    ap.add_argument(
        "--gpu-tests-k",
        default="joint",
        help="pytest -k of tests/test_gpu.py (default: the chi-square tests; '' = all)",
    )
    ap.add_argument("--out", type=output, default="", help="also write the final JSON here")
    args = ap.parse_args(argv)
    for flag, check in (("--device", check_device_name), ("--dtype", check_dtype_name)):
        value = getattr(args, flag[2:])
        try:
            if value is not None:
                check(flag, value)
        except ValueError as e:
            ap.error(str(e))
    for k, v in DEFAULTS["cuda" if args.device.startswith("cuda") else "cpu"].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the check; print and return the report (its JSON is the last stdout line)."""
    args = parse(argv)
    check = Check(args)
    static = graphs.CAPTURE_ON
    if check.dev.type == "cpu":  # a dry run takes the graph path's CPU stand-in too
        graphs.CAPTURE_ON = (*static, "cpu")
    alarm = (  # the hard deadline interrupts whatever runs; the report still comes
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)
    )
    if alarm:
        signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, args.budget_s + GRACE_S)
    watchdog = threading.Timer(args.budget_s + GRACE_S + STUCK_S, _watchdog, (check,))
    watchdog.daemon = True
    watchdog.start()
    try:
        check.run()
    except Deadline:
        check.skipped.append({"step": "(run)", "reason": "interrupted at the deadline"})
    finally:
        graphs.CAPTURE_ON = static
        watchdog.cancel()
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
    report = check.report()
    line = json.dumps(report)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line, flush=True)
    return report


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # no teardown of compile workers and graph pools after the report
