"""The engine's decode forward, scripted layers vs the eager loop, in one process.

`specroll.model.decode` runs the layers of a grad-free CPU forward as one TorchScript
function. This times one decode forward of the policy (cache filled to `--context`
positions, rows a few positions apart) both ways, alternating the order every round,
and reports medians and the scripted/eager ratio per batch size; it also checks that
the two give the same logits and hidden states bit for bit.

    python benchmarks/decode_forward.py [--model smollm2] [--batches 1,4,16,32] [--rounds 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specroll.cli.common import load_policy
from specroll.model import KVCache, decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per row (k + 1 to verify)")
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args()
    model, _ = load_policy(args.model)
    model.eval()
    aux = (1, model.cfg.num_layers // 2, model.cfg.num_layers - 1)  # as a drafter asks
    rows = []
    with torch.inference_mode():
        for B in (int(b) for b in args.batches.split(",")):
            cache = KVCache(model.cfg, B, args.context + args.tokens + 8)
            g = torch.Generator().manual_seed(B)
            tokens = torch.randint(0, model.cfg.vocab_size, (B, args.tokens), generator=g)
            pos = args.context - torch.arange(B) % 5  # [B]
            times: dict[str, list[float]] = {"eager": [], "scripted": []}
            outs = {}
            for r in range(args.rounds + 2):  # 2 warm-up rounds, then interleaved
                for name in ("scripted", "eager") if r % 2 else ("eager", "scripted"):
                    decode.set_scripted(name == "scripted")
                    t = time.perf_counter()
                    outs[name] = model(
                        tokens, pos, cache, hidden_layers=aux, max_start=int(pos.max())
                    )
                    if r >= 2:
                        times[name].append(time.perf_counter() - t)
            decode.set_scripted(True)
            a, b = outs["eager"], outs["scripted"]
            same = torch.equal(a.logits, b.logits) and all(
                torch.equal(a.hidden[i], b.hidden[i]) for i in aux
            )
            ms = {n: statistics.median(v) * 1e3 for n, v in times.items()}
            row = {
                "batch": B,
                "eager_ms": round(ms["eager"], 2),
                "scripted_ms": round(ms["scripted"], 2),
                "scripted_over_eager": round(ms["scripted"] / ms["eager"], 3),
                "bit_equal": same,
            }
            rows.append(row)
            print(row, flush=True)
    config = {k: getattr(args, k) for k in ("model", "tokens", "context", "rounds")}
    config["threads"] = torch.get_num_threads()
    print(json.dumps({"bench": "decode_forward", "config": config, "rows": rows}))


if __name__ == "__main__":
    main()
