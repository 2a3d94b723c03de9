"""What LoRA saves in the learner, and what a refit costs (issue 48).

For each setting (full fine-tuning, and LoRA at each --ranks), in its own process (peak
memory is per process): the run's trainer on --preset, one step's rollouts as a fixed
batch, then --steps updates on it. Reports per setting:
* train_s: the train stage's seconds per update (median of the updates after the first);
* state_bytes: what the learner holds for the policy: weights + gradients + AdamW
  moments (a frozen base has no gradients and no moments);
* peak_rss_mib: the process's peak resident memory (VmHWM, over the whole process), and
  peak_live_mib: the peak of what malloc has handed out (`LivePeak`) over one more update
  after the timed ones and the refits (the engine's copy of the policy resident);
* gen_tok_s: generated tokens per second of the rollouts of step 0 (the engine serving the
  policy as `lora.serve` says; median of two warm repeats);
* refit: bytes a refit carries to the rollout side and seconds of `update_weights`
  (median of --steps refits), for each `lora.serve` (merged, adapters).
Settings run in interleaved order, --repeats times each; medians over repeats.

Prints one JSON line.  Run (16 minutes on 2 cores; each repeat adds as much):
  python benchmarks/lora_cost.py --preset default --ranks 8 32 --steps 4 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def _hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return float("nan")


# struct mallinfo2 (<malloc.h>), every field a size_t
_MALLINFO2 = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class LivePeak:
    """The peak of the bytes malloc has handed out and not taken back (glibc `mallinfo2`:
    heap in use + mapped blocks), sampled every 5 ms in a thread: what the process
    needs at its peak, which its peak RSS overstates by whatever the never-trimmed heap
    (`learner.memory.keep_freed_memory`) holds free. NaN without glibc."""

    def __init__(self) -> None:
        import ctypes
        import threading

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in _MALLINFO2.split()]

        try:
            self._info = ctypes.CDLL("libc.so.6").mallinfo2
            self._info.restype = Info
        except (OSError, AttributeError):
            self._info = None
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self._info is not None:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            m = self._info()
            self.peak = max(self.peak, m.uordblks + m.hblkhd)

    def mib(self) -> float:
        self._stop.set()
        return round(self.peak / 2**20, 1) if self._info is not None else float("nan")


def one(preset: str, rank: int, serve: str, steps: int) -> dict:
    """One setting in this process."""
    import tempfile

    import torch

    from specroll.model import load_model
    from specroll.model.hub import resolve
    from specroll.model.tokenizer import Tokenizer
    from specroll.rl.algo.batch import Batch
    from specroll.rl.config import build_config
    from specroll.rl.replica import Weights
    from specroll.rl.run.draft import build_draft
    from specroll.rl.run.trainer import Trainer

    torch.set_num_threads(2)
    out = tempfile.mkdtemp(prefix="lora-cost-")
    over = [f"pipeline.out_dir={out}", f"lora.rank={rank}", f"lora.serve={serve}"]
    cfg = build_config(preset, over)
    path = resolve(cfg.policy.model)
    policy, tok = load_model(path), Tokenizer(path)
    draft = build_draft(cfg, policy, tok, path, log=lambda m: None)
    t = Trainer(cfg, policy, tok, draft, log=lambda m: None)
    results = t.rollout.generate(t.task.step_requests(0))
    gen = []  # warm: the same requests again (their seeds: the same tokens)
    for _ in range(2):
        t0 = time.perf_counter()
        again = t.rollout.generate(t.task.step_requests(0))
        gen.append(sum(len(r.token_ids) for r in again) / (time.perf_counter() - t0))
    adv = torch.tensor([1.0, -1.0] * (len(results) // 2))
    batch = Batch.from_results(results, adv)
    learner = t.host.learner
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        t.host.train(batch, None, None, lr=t.cfg.policy_lr())
        times.append(time.perf_counter() - t0)
    trained = learner.trained
    weights = sum(p.numel() * p.element_size() for p in learner.policy.parameters())
    grads = sum(p.numel() * p.element_size() for p in trained)
    moments = sum(
        v.numel() * v.element_size()
        for s in learner.opt.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    refits, sent = [], 0
    for v in range(steps):
        w = t.host.weights()
        sent = sum(x.numel() * x.element_size() for x in w.policy.values())
        t0 = time.perf_counter()
        t.rollout.update_weights(v + 1, Weights(w.policy, None))
        refits.append(time.perf_counter() - t0)
    # one more update, sampled: the sampler's calls take malloc's lock and walk its free
    # lists, which would slow the timed updates (by half on the default preset)
    live = LivePeak()
    t.host.train(batch, None, None, lr=t.cfg.policy_lr())
    peak_live = live.mib()
    t.close()
    return {
        "train_s": statistics.median(times[1:] or times),
        "state_bytes": weights + grads + moments,
        "trained_params": sum(p.numel() for p in trained),
        "peak_rss_mib": round(_hwm_mib(), 1),
        "peak_live_mib": peak_live,
        "gen_tok_s": round(statistics.median(gen), 1),
        "refit_bytes": sent,
        "refit_s": statistics.median(refits[1:] or refits),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one", nargs=3, metavar=("RANK", "SERVE", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        rank, serve, steps = int(args.one[0]), args.one[1], int(args.one[2])
        print(json.dumps(one(args.preset, rank, serve, steps)))
        return
    settings = [(0, "merged")] + [(r, s) for r in args.ranks for s in ("merged", "adapters")]
    got: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for rank, serve in settings:
            name = "full" if rank == 0 else f"r{rank}-{serve}"
            cmd = [sys.executable, __file__, "--preset", args.preset]
            cmd += ["--one", str(rank), serve, str(args.steps)]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            got.setdefault(name, []).append(json.loads(line.strip().splitlines()[-1]))
            print(f"repeat {rep}: {name} {got[name][-1]}", file=sys.stderr, flush=True)
    out = {
        name: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        for name, rows in got.items()
    }
    config = {k: v for k, v in vars(args).items() if k != "one"}
    print(json.dumps({"settings": out, "config": config}))


if __name__ == "__main__":
    main()
