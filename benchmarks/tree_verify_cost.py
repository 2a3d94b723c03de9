"""What a draft tree costs to verify: engine iteration time with trees of n nodes per row
against plain decoding, per batch size, on the machine at hand (CPU or GPU).

Acceptance does not depend on the hardware (`benchmarks/history_acceptance.py` measures
it); cost does. This measures the cost with the policy's architecture and random weights
(the time of a forward does not depend on the weights), so it runs where the weights are
not available: a random tree drafter proposes n nodes per row every iteration, and the
figure is wall time per engine iteration (the prefill's time taken off) over the plain
engine's, interleaved, median of repeats. Projected speed-up at a batch size = tokens
per iteration (measured acceptance) / this ratio. `--chains` adds chains of k random
candidates (the chain verifier) at the same widths: tree over chain is what the tree path
itself costs (mask, walk, path compaction), the term the simulator adds to a chain's.

    python benchmarks/tree_verify_cost.py --config scratch/smollm2_config.json --device cuda
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from specroll.device import synchronize
from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine.depth import FixedDepth
from specroll.engine.profile import RandomTree
from specroll.model import ModelConfig, Transformer
from specroll.model.weights import for_inference

sys.path.insert(0, str(Path(__file__).parent))
from bench_io import Parser, output  # noqa: E402


def main() -> None:
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="an HF config.json of the policy")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--nodes", default="3,8,16,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chains", default="", help="chain widths to time beside the trees")
    ap.add_argument("--out", type=output, default="", help="also write the final JSON here")
    args = ap.parse_args()
    cfg = ModelConfig.from_hf(json.loads(Path(args.config).read_text()))
    model = for_inference(Transformer(cfg).init_weights(0), args.device, getattr(torch, args.dtype))
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(1)
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        reqs = [
            Request(
                torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist(),
                SamplingParams(1.0, max_new_tokens=args.new_tokens, stop_token_ids=(), seed=i),
            )
            for i in range(B)
        ]
        engines = {"plain": Engine(model, EngineConfig(max_batch=B))}
        for n in [int(x) for x in args.nodes.split(",")]:
            engines[f"tree{n}"] = Engine(
                model, EngineConfig(max_batch=B), RandomTree(cfg.vocab_size), FixedDepth(n)
            )
        for n in [int(x) for x in args.chains.split(",") if x]:
            chain = RandomTree(cfg.vocab_size, chain=True)
            engines[f"chain{n}"] = Engine(model, EngineConfig(max_batch=B), chain, FixedDepth(n))
        times: dict[str, list[float]] = {k: [] for k in engines}
        for eng in engines.values():
            eng.generate(reqs[:1])  # warm-up
        # the prefill alone (one token per request), taken off every run's time
        first = [Request(r.prompt_ids, replace(r.params, max_new_tokens=1)) for r in reqs]

        def timed(eng: Engine, batch: list[Request]) -> tuple[float, int]:
            synchronize(dev)
            t0 = time.perf_counter()
            out = eng.generate(batch)
            synchronize(dev)
            return time.perf_counter() - t0, out.stats.target_forwards

        for _ in range(args.repeats):
            for name, eng in engines.items():
                prefill, _ = timed(engines["plain"], first)
                total, forwards = timed(eng, reqs)
                times[name].append((total - prefill) / max(forwards, 1))
        base = statistics.median(times["plain"])
        for name in engines:
            t = statistics.median(times[name])
            row = {
                "batch": B,
                "mode": name,
                "ms_per_iter": round(t * 1e3, 3),
                "cost_vs_plain": round(t / base, 3),
            }
            print(row, flush=True)
            rows.append(row)
    final = {
        "bench": "tree_verify_cost",
        "device": str(dev),
        "dtype": args.dtype,
        "config": args.config,
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(final) + "\n")
    print(json.dumps(final))


if __name__ == "__main__":
    main()
