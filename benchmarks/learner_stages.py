"""Where a learner step's time goes on SmolLM2-135M, stage by stage, fp32 and bf16.

The workload is a default-preset step: 4 math prompts x 8 samples (32 sequences), the
prompts of the default task (`tasks.sets.math_problems`, chat template) and random
responses of 64..128 tokens (`--lengths`; the learner's cost does not depend on which
tokens they are), T = 1, micro-batches of `policy.micro_batch` sequences, with and
without the online EAGLE-3 draft (`draft.init=random`, the default shape).

Stages (each configuration's figure is the median over `--repeats`, configurations
interleaved in one process: the machine is shared, so compare ratios within a run):

* `logprob`  the no-grad forward of stage `logprob` (`Learner.logprobs`);
* `train`    stage `train` (`Learner.train`): forward + backward + both optimizer steps;
* `optim`    the policy's gradient clipping + AdamW step alone (for-loop / foreach / fused);
* `head`     LM head + log-softmax + gather of one micro-batch, forward and forward +
             backward: the plain path (every position's [B, T, V] logits) vs the learner's
             (`head_logprobs`: response positions, in chunks);
* `attn`     the 30 layers' attention (SDPA, masked, GQA folded) of one micro-batch.

Two head paths run the same learner: `plain` is the learner before issue 15 (the model's
full logits, `sequence_logprobs`), `chunked` the current one (`Learner.forward`).

FLOPs: a matmul of an [M, K] by a [K, N] is 2 M K N; a forward is 2 x (the decoder's
matrix parameters) per padded token, plus 2 H V per position the LM head runs at (every
position for `plain`, the response for `chunked`), plus attention 4 T^2 hd per head per
sequence (the masked kernel computes the full square); a backward is twice its forward.
`gflops` is what each path executes; `model_gflops` counts one fixed workload (head at
every real token, causal attention) for every path, so it is proportional to speed.
The draft's FLOPs are not counted (its time is). Prints tables, then one JSON line.

    python benchmarks/learner_stages.py [--repeats 3] [--dtypes float32,bfloat16]
        [--draft both|on|off] [--micro-batch 16] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specroll.cli.common import load_policy
from specroll.drafting.ttt import loss_mask
from specroll.model.ops import attention, fold_mask
from specroll.rl.algo.batch import Batch
from specroll.rl.algo.logprobs import head_logprobs, sequence_logprobs
from specroll.rl.config import build_config
from specroll.rl.learner.build import build_learner
from specroll.rl.learner.learner import Learner
from specroll.rl.run.draft import build_draft
from specroll.tasks.sets import encode, math_problems


def make_batch(tok, prompts: int, group: int, lo: int, hi: int, vocab: int, seed: int) -> Batch:
    """`prompts` x `group` sequences: a default-task prompt + a random response of lo..hi
    tokens (behaviour log-probs: small negatives on the response)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p in math_problems(prompts, seed=seed):
        ids = encode(tok, p)
        for _ in range(group):
            n = int(torch.randint(lo, hi + 1, (1,), generator=g))
            rows.append((ids, torch.randint(0, vocab, (n,), generator=g).tolist()))
    W = max(len(a) + len(b) for a, b in rows)
    tokens = torch.zeros(len(rows), W, dtype=torch.long)
    for i, (a, b) in enumerate(rows):
        tokens[i, : len(a) + len(b)] = torch.tensor(a + b)
    batch = Batch(
        tokens,
        torch.tensor([len(a) for a, _ in rows]),
        torch.tensor([len(a) + len(b) for a, b in rows]),
        torch.randn(len(rows), generator=g),
        torch.zeros(len(rows), W),
    )
    batch.behaviour_logp = -torch.rand(len(rows), W, generator=g) * batch.response_mask
    return batch


def plain_forward(self: Learner, model, b: Batch, vocab=None, where=None):
    """The learner's forward before issue 15: the model's [B, W, V] logits, `sequence_logprobs`,
    and the draft target from the same full logits (the `plain` head path)."""
    last = model.cfg.num_layers
    layers = self.hidden_layers if model is self.policy else (last,)
    with self._autocast():
        out = model(b.tokens, hidden_layers=layers)
    logp = sequence_logprobs(out.logits, b.tokens, self.temperature) * b.response_mask
    target = None
    if vocab is not None:
        mask = loss_mask(b.lengths, b.prompt_lens, b.tokens.shape[1])
        with torch.no_grad():
            target = F.log_softmax(out.logits.detach()[mask].float() / self.temperature, -1)
            target = target[:, vocab]
    return logp, target, out.hidden


class Configured:
    """One learner whose head path, dtype and draft are switched per configuration (one
    set of weights and optimizer states in memory for every configuration)."""

    def __init__(self, learner: Learner) -> None:
        self.lr = learner
        self.draft = (learner.draft, learner.draft_opt, learner.hidden_layers)
        self.last = (learner.policy.cfg.num_layers,)

    def set(self, impl: str, dtype: torch.dtype, draft: bool) -> Learner:
        lr = self.lr
        lr.dtype = dtype
        d, opt, layers = self.draft
        lr.draft, lr.draft_opt, lr.hidden_layers = (
            (d, opt, layers) if draft else (None, None, self.last)
        )
        if impl == "plain":
            lr.forward = plain_forward.__get__(lr)
        else:
            lr.__dict__.pop("forward", None)
        return lr


def flops(cfg, batch: Batch, micro: int, head_at: str) -> float:
    """Executed forward FLOPs of the learner on `batch` (see the module docstring)."""
    H, V, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv, inter = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size
    per_tok = cfg.num_layers * (H * (q + 2 * kv) + q * H + H * 2 * inter + inter * H)
    lengths = sorted(batch.lengths.tolist())
    total = 0.0
    for s in range(0, len(lengths), micro):
        rows = lengths[s : s + micro]
        W = max(rows)
        total += 2 * per_tok * W * len(rows)
        total += 4 * cfg.num_layers * cfg.num_heads * hd * W * W * len(rows)
        if head_at == "all":
            total += 2 * H * V * W * len(rows)
    if head_at == "response":
        total += 2 * H * V * int(batch.response_mask.sum())
    return total


def model_flops(cfg, batch: Batch) -> float:
    """The fixed workload's forward FLOPs: head at every real token, causal attention."""
    H, V, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv, inter = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size
    per_tok = cfg.num_layers * (H * (q + 2 * kv) + q * H + H * 2 * inter + inter * H) + H * V
    lengths = batch.lengths.tolist()
    attn = sum(2 * cfg.num_layers * cfg.num_heads * hd * n * n for n in lengths)
    return 2 * per_tok * sum(lengths) + attn


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def optim_variants(policy, lr: float) -> dict[str, torch.optim.Optimizer]:
    """AdamW implementations to compare on the same parameters (each its own state)."""
    params = list(policy.parameters())
    out = {"forloop": torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), foreach=False)}
    out["foreach"] = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), foreach=True)
    with contextlib.suppress(RuntimeError, ValueError):
        out["fused"] = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), fused=True)
    return out


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--impls", default="plain,chunked")
    ap.add_argument("--draft", choices=("both", "on", "off"), default="both")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lengths", default="64,128", help="response lengths lo,hi")
    ap.add_argument("--stages", default="logprob,train,optim,head,attn")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="torch.profiler of one train")
    return ap.parse_args()


def response_lengths(args: argparse.Namespace) -> tuple[int, int]:
    lo, hi = (int(x) for x in args.lengths.split(","))
    return lo, hi


def build_workload(args: argparse.Namespace, with_draft: bool) -> tuple:
    """(policy, batch, learner): SmolLM2, the step's batch, and a default-preset learner
    (with a random EAGLE-3 draft when `with_draft`)."""
    policy, tok = load_policy("smollm2")
    cfg = build_config("default", ["draft.init=random", f"policy.micro_batch={args.micro_batch}"])
    lo, hi = response_lengths(args)
    batch = make_batch(tok, args.prompts, args.group, lo, hi, policy.cfg.vocab_size, args.seed)
    draft = build_draft(cfg, policy, tok, None) if with_draft else None
    learner = build_learner(cfg, policy, draft, torch.device("cpu"))
    return policy, batch, learner


def describe_setup(args: argparse.Namespace, batch: Batch) -> dict:
    """The run's configuration (printed first, and the JSON line's `setup`)."""
    lo, hi = response_lengths(args)
    return dict(
        model="smollm2-135m",
        sequences=batch.tokens.shape[0],
        prompt_len=sorted(set(batch.prompt_lens.tolist())),
        response_len=[lo, hi],
        tokens=int(batch.lengths.sum()),
        response_tokens=int(batch.response_mask.sum()),
        micro_batch=args.micro_batch,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        repeats=args.repeats,
    )


def time_configs(
    conf: Configured,
    batch: Batch,
    old: torch.Tensor,
    configs: list[tuple[str, str, bool]],
    dtypes: dict,
    stages: list[str],
    args: argparse.Namespace,
) -> dict[str, dict]:
    """Stages `logprob` and `train` of every (impl, dtype, draft) configuration, `--repeats`
    rounds in a rotating order; per configuration the times and the executed forward FLOPs."""
    mc = conf.lr.policy.cfg
    results: dict[str, dict] = {}
    for r in range(args.repeats):
        for impl, dname, dr in configs[r % len(configs) :] + configs[: r % len(configs)]:
            lr = conf.set(impl, dtypes[dname], dr)
            key = f"{impl}/{dname}/{'draft' if dr else 'nodraft'}"
            res = results.setdefault(key, {"logprob": [], "train": []})
            head_at = "all" if impl == "plain" else "response"
            res["fwd_flops"] = flops(mc, batch, args.micro_batch, head_at)
            if "logprob" in stages and not dr:  # the no-grad forward has no draft
                res["logprob"].append(timed(lambda lr=lr: lr.logprobs(batch)))
            if "train" in stages:
                res["train"].append(timed(lambda lr=lr: lr.train(batch, old - 0.01)))
            print(key, {k: round(v[-1], 2) for k, v in res.items() if isinstance(v, list) and v})
    return results


def stage_table(results: dict[str, dict], n_tok: int, fwd_model: float) -> dict[str, dict]:
    """Per configuration and stage: median seconds, tokens/s, executed and model GFLOP/s."""
    table = {}
    for key, res in results.items():
        row = {}
        for stage, mult in (("logprob", 1), ("train", 3)):
            if res[stage]:
                s = statistics.median(res[stage])
                row[stage] = dict(
                    s=round(s, 3),
                    tok_s=round(n_tok / s, 1),
                    gflops=round(mult * res["fwd_flops"] / s / 1e9, 1),
                    model_gflops=round(mult * fwd_model / s / 1e9, 1),
                )
        table[key] = row
        print(key, row)
    return table


def optim_stage(learner: Learner, policy, batch: Batch, old: torch.Tensor, repeats: int) -> dict:
    """Gradient clipping + AdamW step of the policy, per implementation (median seconds)."""
    learner.train(batch, old - 0.01)  # gradients to step on
    variants = optim_variants(policy, 0.0)
    times: dict[str, list[float]] = {k: [] for k in variants}
    params = list(policy.parameters())
    for _ in range(repeats + 1):  # the first round allocates the states
        for name, opt in variants.items():

            def step(opt=opt, name=name):
                torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=name != "forloop")
                opt.step()

            times[name].append(timed(step))
    out = {k: round(statistics.median(v[1:]), 3) for k, v in times.items()}
    del variants
    print("optim", out)
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    stages = args.stages.split(",")
    dtypes = {n: getattr(torch, n) for n in args.dtypes.split(",")}
    impls = args.impls.split(",")
    drafts = {"both": (False, True), "on": (True,), "off": (False,)}[args.draft]

    policy, batch, learner = build_workload(args, True in drafts)
    conf = Configured(learner)
    setup = describe_setup(args, batch)
    print(json.dumps(setup))
    fwd_model = model_flops(policy.cfg, batch)
    old = learner.logprobs(batch)  # warm-up (and the old log-probs of every train)

    configs = [(i, d, dr) for i in impls for d in dtypes for dr in drafts]
    results = time_configs(conf, batch, old, configs, dtypes, stages, args)
    table = stage_table(results, setup["tokens"], fwd_model)

    extra: dict = {}
    if "optim" in stages:
        extra["optim_s"] = optim_stage(learner, policy, batch, old, args.repeats)
    mb = batch.rows(list(range(min(args.micro_batch, batch.tokens.shape[0]))))
    if "head" in stages:
        extra["head"] = head_stage(policy, mb, dtypes, args.repeats)
    if "attn" in stages:
        extra["attn"] = attn_stage(policy, mb, dtypes, args.repeats)
    if args.profile:
        profile_train(conf, batch, old)
    print(json.dumps({"setup": setup, "stages": table, **extra}))


def head_stage(policy, b: Batch, dtypes: dict, repeats: int) -> dict:
    """LM head + log-softmax + gather of one micro-batch: plain vs chunked, fwd / fwd+bwd."""
    L = policy.cfg.num_layers
    with torch.no_grad():
        h = policy(b.tokens, hidden_layers=(L,), return_logits=False).hidden[L]
    w = policy.head_weight
    sel = b.response_mask[:, 1:]
    H, V = policy.cfg.hidden_size, policy.cfg.vocab_size
    B, W = b.tokens.shape
    n = int(sel.sum())

    def plain(grad: bool, dtype):
        x = h.detach().requires_grad_(grad)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = (policy.final_state(x) @ w).float()
        lp = sequence_logprobs(logits, b.tokens, 1.0)
        if grad:
            (lp[:, 1:] * sel).sum().backward()

    def chunked(grad: bool, dtype):
        x = h.detach().requires_grad_(grad)
        final = policy.final_state(x)[:, :-1][sel]
        lp, _ = head_logprobs(final, w, b.tokens[:, 1:][sel], 1.0, dtype=dtype)
        if grad:
            lp.sum().backward()

    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for dname, dt in dtypes.items():
            for name, fn in (("plain", plain), ("chunked", chunked)):
                for grad in (False, True):
                    key = f"{name}/{dname}/{'fwd_bwd' if grad else 'fwd'}"
                    with torch.set_grad_enabled(grad):
                        times.setdefault(key, []).append(
                            timed(lambda fn=fn, g=grad, d=dt: fn(g, d))
                        )
                    w.grad = None
    out = {}
    for key, v in times.items():
        s = statistics.median(v)
        rows = B * W if key.startswith("plain") else n
        mult = 3 if key.endswith("fwd_bwd") else 1
        out[key] = dict(s=round(s, 3), gflops=round(mult * 2 * H * V * rows / s / 1e9, 1))
    print("head", out)
    return out


def attn_stage(policy, b: Batch, dtypes: dict, repeats: int) -> dict:
    """The layers' SDPA calls of one micro-batch (random q/k/v of the right shapes)."""
    c = policy.cfg
    B, W = b.tokens.shape
    g = c.num_heads // c.num_kv_heads
    local = torch.arange(W)
    mask = fold_mask((local.view(1, -1) <= local.view(-1, 1)).expand(B, W, W), g)
    out = {}
    for dname, dt in dtypes.items():
        q = torch.randn(B, W, c.num_heads, c.head_dim, dtype=dt)
        k = torch.randn(B, c.num_kv_heads, W, c.head_dim, dtype=dt)
        v = torch.randn_like(k)
        for grad in (False, True):
            qq, kk, vv = (t.clone().requires_grad_(grad) for t in (q, k, v))

            def run(qq=qq, kk=kk, vv=vv, grad=grad):
                for _ in range(c.num_layers):
                    o = attention(qq, kk, vv, mask, c.head_dim**-0.5)
                    if grad:
                        o.sum().backward()

            with torch.set_grad_enabled(grad):
                s = statistics.median(timed(run) for _ in range(repeats))
            fl = 4 * c.num_layers * c.num_heads * c.head_dim * W * W * B * (3 if grad else 1)
            out[f"{dname}/{'fwd_bwd' if grad else 'fwd'}"] = dict(
                s=round(s, 3), gflops=round(fl / s / 1e9, 1)
            )
    print("attn", out)
    return out


def profile_train(conf: Configured, batch: Batch, old: torch.Tensor) -> None:
    """torch.profiler table of one fp32 train stage on the chunked path, no draft."""
    from torch.profiler import ProfilerActivity, profile

    lr = conf.set("chunked", torch.float32, False)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        lr.train(batch, old - 0.01)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
