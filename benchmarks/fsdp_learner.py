"""Memory and step time of the learner on one process vs `--ranks` FSDP2 ranks (SmolLM2).

The workload of `learner_stages.py` (default-task prompts, random responses of 64..128
tokens, T = 1) with the online EAGLE-3 draft (`draft.init=random`), fp32. Each
configuration runs in its own process (`--mode`), so that its resident memory is its own:

* `single`  a `LocalLearnerHost` in this process;
* `fsdp`    an `FSDPLearnerHost` (local rank processes, gloo).

Memory is each learner process's peak resident set (VmHWM) per phase: reset through
/proc/self/clear_refs before the phase, read after it (`fsdp.rank.rank_memory`); the
phases are `build` (after construction), `publish` (`weights()`, before any training:
the single host returns views; rank 0 of the FSDP host gathers tensor by tensor and
streams them to the driver) and `train` (updates after a warm-up one). The driver's own
peak during publish (where the full copy lands) is reported as `driver_publish`. Step
time: the median of `--repeats` updates. Prints one JSON line.

    python benchmarks/fsdp_learner.py --mode single|fsdp [--ranks 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from learner_stages import make_batch  # a sibling script

from specroll.cli.common import load_policy
from specroll.rl.config import build_config
from specroll.rl.learner import build_host
from specroll.rl.learner.fsdp.rank import rank_memory
from specroll.rl.run.draft import build_draft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("single", "fsdp"), required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    a = ap.parse_args()
    over = ["draft.init=random", "learner.device=cpu"]
    if a.mode == "fsdp":
        over += ["learner.strategy=fsdp", f"learner.ranks={a.ranks}"]
    cfg = build_config("default", over)
    policy, tok = load_policy(cfg.policy.model)
    draft = build_draft(cfg, policy, tok, None)
    batch = make_batch(tok, a.prompts, a.group, 64, 128, policy.cfg.vocab_size, seed=0)
    host = build_host(cfg, policy, draft)
    if a.mode == "single":
        del policy, draft  # the host holds them

    def memory() -> list[dict]:
        return host.memory() if a.mode == "fsdp" else [{"rank": 0, **rank_memory()}]

    out: dict = {"mode": a.mode, "ranks": a.ranks if a.mode == "fsdp" else 1}
    rank_memory()
    out["build"] = memory()
    # publish before training: the learner keeps freed heap memory (`keep_freed_memory`),
    # so a phase's peak shows only above the earlier phases' peaks
    t0 = time.perf_counter()
    weights = host.weights()
    out["publish_s"] = round(time.perf_counter() - t0, 3)
    out["publish"] = memory()
    out["driver_publish"] = rank_memory()
    tensors = [t for w in (weights.policy, weights.draft) if w for t in w.values()]
    out["published_mib"] = round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 1)
    del weights
    old, _ = host.logprobs(batch)
    host.train(batch, old, None)  # warm-up
    memory()
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        host.train(batch, old, None)
        times.append(time.perf_counter() - t0)
    out["train"] = memory()
    out["train_s"] = round(statistics.median(times), 3)
    out["sequences"], out["tokens"] = len(batch.lengths), int(batch.lengths.sum())
    host.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
