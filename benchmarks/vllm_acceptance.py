"""Acceptance of one EAGLE-3 draft in specroll's engine and in vLLM, same requests.

vLLM's default `draft_sample_method="greedy"` proposes the argmax of q (exact, accepted
with probability p(argmax)); specroll's engine samples drafts from q. This measures both
vLLM modes beside the engine: 16 built-in prompts, T = 1, 128 tokens, stop tokens off,
k = 3. Prints the figures, then one JSON line.

    .venv-vllm/bin/python benchmarks/vllm_acceptance.py <EAGLE-3 draft dir> [--batch 16]
"""

from __future__ import annotations

import argparse
import json

from specroll.cli.common import load_policy
from specroll.drafting import registry
from specroll.engine import Engine, EngineConfig, Request, SamplingParams
from specroll.engine.depth import FixedDepth
from specroll.engine.prompts import BUILTIN_PROMPTS
from specroll.model.hub import resolve
from specroll.rl.rollout.vllm import VllmRollout
from specroll.spec.metrics import SpecStats

K = 3


def summary(s: SpecStats) -> dict:
    """Acceptance length (tokens per verification) and per-position acceptance."""
    per_pos = zip(s.accepted_per_pos, s.drafted_per_pos, strict=True)
    return dict(
        acceptance_length=round(1 + s.accepted_tokens / max(s.drafts, 1), 4),
        per_position=[round(a / max(d, 1), 4) for a, d in per_pos],
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("draft")
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    policy, tok = load_policy("smollm2")
    params = lambda i: SamplingParams(1.0, max_new_tokens=128, stop_token_ids=(), seed=i)  # noqa: E731
    prompts = [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(args.batch)]
    reqs = [Request(tok.encode_prompt(t), params(i)) for i, t in enumerate(prompts)]
    drafter = registry.build(f"eagle3:{args.draft}", policy)
    eng = Engine(policy, EngineConfig(max_batch=args.batch), drafter, FixedDepth(K, max_batch=64))
    eng.generate(reqs)
    out = {"specroll": summary(eng.stats)}
    for mode in ("greedy", "probabilistic"):
        v = VllmRollout(resolve("smollm2"), args.draft, "eagle3", K, max_batch=args.batch,
                        draft_sample=mode, log=lambda m: None)  # fmt: skip
        out[f"vllm-{mode}"] = summary(v.generate_now(reqs).stats)
        v.close()
    for name, r in out.items():
        print(f"{name:20s} AL {r['acceptance_length']:.4f}  per position {r['per_position']}")
    config = {"batch": args.batch, "temperature": 1.0, "k": K, "new_tokens": 128}
    print(json.dumps({"config": config, "results": out}))


if __name__ == "__main__":
    main()
