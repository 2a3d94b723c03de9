"""How high can draft acceptance go for this policy at T = 1? Yardsticks on its own samples.

A draft token is accepted with probability sum_x min(p(x), q(x)) (1 - total variation):
a draft must match the policy's whole tempered distribution, not only its top token. So
acceptance is bounded by how concentrated and how predictable that distribution is.
This script samples the policy on held-out math prompts at the RL settings and reports,
token-weighted over the responses:

  * the policy's mean entropy and mean top-1 probability (a draft that always proposed the
    policy's own argmax token, known in advance, would be accepted with that mean max-p);
  * early exits of the policy itself: q = softmax(head(norm(h_l))) from the residual stream
    after l of its layers, for several l. The last exit reuses all but the final layer(s)
    of the policy: far more capacity and information than a one-layer draft has;
  * for each, the acceptance length at k = 3 that a per-position acceptance a implies
    (1 + a + a^2 + a^3, position-independent: optimistic, since acceptance falls with
    depth in practice);
  * with --draft DIR, the held-out per-step acceptance recorded when that EAGLE-3 draft
    was trained (its train_summary.json).

Prints a table and one JSON line. Run:

    python benchmarks/draft_ceiling.py [--n 64] [--draft DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from specroll.drafting.evaluate import EVAL_SEED
from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.request import Request, SamplingParams
from specroll.model import load_model
from specroll.model.hub import resolve
from specroll.model.tokenizer import Tokenizer
from specroll.tasks.sets import encode, prompt_set


def implied_al(a: float, k: int = 3) -> float:
    """Acceptance length at depth k when every position is accepted with probability a."""
    return sum(a**i for i in range(k + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="smollm2")
    ap.add_argument("--n", type=int, default=64, help="held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--exits", default="10,15,20,24,27,28,29", help="layers after which to exit")
    ap.add_argument("--draft", default=None, help="EAGLE-3 draft dir with train_summary.json")
    args = ap.parse_args()

    path = resolve(args.policy)
    policy, tok = load_model(path).eval(), Tokenizer(path)
    exits = [int(x) for x in args.exits.split(",")]
    if not all(1 <= e < policy.cfg.num_layers for e in exits):
        raise ValueError(f"--exits must be in 1..{policy.cfg.num_layers - 1}, got {exits}")
    prompts = [encode(tok, p) for p in prompt_set("math", args.n, EVAL_SEED)]  # held out
    reqs = [
        Request(p, SamplingParams(args.temperature, max_new_tokens=args.max_new_tokens, seed=i))
        for i, p in enumerate(prompts)
    ]
    outs = Engine(policy, EngineConfig(max_batch=16)).generate(reqs)

    ent, maxp, acc = [], [], {e: [] for e in exits}
    T = args.temperature
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs, strict=True):
            if len(out.token_ids) < 1:
                continue
            seq = torch.tensor([prompt + list(out.token_ids)])  # [1, P + R]
            first = len(prompt) - 1  # logits at this position predict the first response token
            res = policy(seq, hidden_layers=exits)
            p = F.softmax(res.logits[0, first:-1] / T, dim=-1)  # [R, V]
            ent.append(-(p * p.clamp_min(1e-30).log()).sum(-1))
            maxp.append(p.max(-1).values)
            for e in exits:
                h = res.hidden[e][0, first:-1]  # [R, H]
                h = F.rms_norm(h, (h.shape[-1],), policy.norm, policy.cfg.rms_norm_eps)
                q = F.softmax((h @ policy.head_weight) / T, dim=-1)  # [R, V]
                acc[e].append(torch.minimum(p, q).sum(-1))

    n_tok = sum(len(x) for x in ent)
    mean_maxp = float(torch.cat(maxp).mean())
    rows = [{"q": "policy argmax (oracle top-1)", "accept": round(mean_maxp, 4)}]
    L = policy.cfg.num_layers
    for e in exits:
        a = float(torch.cat(acc[e]).mean())
        rows.append({"q": f"policy exit after {e}/{L} layers", "accept": a})
    if args.draft:
        summary = json.loads((Path(args.draft) / "train_summary.json").read_text())
        for j, a in enumerate(summary["held_out"]["accept"]):
            rows.append({"q": f"EAGLE-3 draft, step {j} (training held-out)", "accept": a})
    for r in rows:
        r["accept"] = round(r["accept"], 4)
        r["implied_al_k3"] = round(implied_al(r["accept"]), 3)

    mean_ent = float(torch.cat(ent).mean())
    print(f"{n_tok} response tokens; entropy {mean_ent:.3f} nats, max-p {mean_maxp:.3f}")
    print(f"{'draft distribution q':45s} {'accept':>7} {'AL@k=3':>7}")
    for r in rows:
        print(f"{r['q']:45s} {r['accept']:>7.3f} {r['implied_al_k3']:>7.3f}")
    print(
        json.dumps(
            {
                "bench": "draft_ceiling",
                "policy": args.policy,
                "n": args.n,
                "temperature": T,
                "max_new_tokens": args.max_new_tokens,
                "tokens": n_tok,
                "entropy_nats": round(mean_ent, 4),
                "mean_max_p": round(mean_maxp, 4),
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
