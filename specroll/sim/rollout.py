"""Rollout simulation: continuous batching with a shrinking batch, with or without drafts.

One generation replica holds at most `max_batch` sequences; finished ones free their slot
for queued ones (each admission costs a prefill), so the batch stays full until the
queue empties and then shrinks to the longest sample — the tail that dominates RL
rollouts (Seer: the last 10% of requests can take half the time). Each iteration the
depth policy picks k for the live batch; a row then advances by the expected emitted
tokens tau(k) = 1 + sum_i prod_{j<=i} alpha_j (mean-field: rows advance by the
expectation, not a sampled count). Time per iteration comes from any step model with
the `iteration(B, k, ctx)` interface (analytic or measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Workload:
    """Prompts x samples and the response-length distribution (log-normal, capped)."""

    prompts: int = 512
    samples: int = 16
    prompt_len: int = 256
    mean_len: float = 4000.0
    """Mean of the uncapped log-normal response length (tokens)."""
    sigma: float = 0.8
    """Log-space standard deviation (0 = every response has mean_len tokens)."""
    max_len: int = 16384
    """Cap: longer responses are truncated (their mass piles up at the cap)."""
    seed: int = 0
    lengths: list[int] | None = None
    """Explicit response lengths (e.g. from a run's metrics) instead of the distribution."""

    def draw(self) -> torch.Tensor:
        """[prompts * samples] response lengths."""
        if self.lengths is not None:
            return torch.tensor(self.lengths, dtype=torch.float64)
        n = self.prompts * self.samples
        g = torch.Generator().manual_seed(self.seed)
        mu = math.log(self.mean_len) - self.sigma**2 / 2
        x = torch.exp(mu + self.sigma * torch.randn(n, generator=g, dtype=torch.float64))
        return x.clamp(1, self.max_len).round()


@dataclass
class Speculation:
    """How the simulated engine drafts."""

    k: int = 0
    """Draft depth (fixed), or the deepest one considered (adaptive); 0 = plain decoding."""
    alphas: list[float] = field(default_factory=list)
    """Conditional per-position acceptance alpha_1..alpha_k (see tau)."""
    adaptive: bool = False
    """Pick k in 0..k per iteration to maximise tokens/s (else always k)."""

    def tau(self, k: int) -> float:
        out, run = 1.0, 1.0
        for a in self.alphas[:k]:
            run *= a
            out += run
        return out

    @staticmethod
    def from_acceptance_length(al: float, k: int) -> Speculation:
        """Constant alpha with 1 + a + ... + a^k = al (how papers report acceptance)."""
        lo, hi = 0.0, 1.0
        for _ in range(60):
            a = (lo + hi) / 2
            lo, hi = (a, hi) if sum(a**i for i in range(k + 1)) < al else (lo, a)
        return Speculation(k=k, alphas=[lo] * k)


def simulate_replica(
    step, lengths: torch.Tensor, max_batch: int, prompt_len: int, spec: Speculation
) -> dict:
    """Generation time of one replica for `lengths` (its share of the samples)."""
    remaining = lengths.clone()
    queue = list(range(len(lengths)))
    active: list[int] = []
    done_tokens = torch.zeros_like(lengths)
    t, iters = 0.0, 0
    trace: list[tuple[float, int, int]] = []
    while queue or active:
        if queue and len(active) < max_batch:
            new = queue[: max_batch - len(active)]
            queue = queue[len(new) :]
            active += new
            t += step.prefill(len(new), prompt_len) if hasattr(step, "prefill") else 0.0
        B = len(active)
        ctx = prompt_len + float(done_tokens[active].mean())
        ks = range(spec.k + 1) if spec.adaptive else [spec.k]
        k = max(ks, key=lambda kk: spec.tau(kk) / step.iteration(B, kk, ctx))
        dt = step.iteration(B, k, ctx)
        adv = spec.tau(k)
        idx = torch.tensor(active)
        done_tokens[idx] += adv
        remaining[idx] -= adv
        t += dt
        iters += 1
        if iters % 16 == 1 or len(trace) < 64:
            trace.append((round(t, 4), B, k))
        active = [i for i in active if remaining[i] > 0]
    return {"time": t, "iterations": iters, "trace": trace}


def simulate_rollout(
    step, workload: Workload, replicas: int, max_batch: int, spec: Speculation
) -> dict:
    """Sync rollout over `replicas` generation replicas: the step waits for the slowest."""
    lengths = workload.draw()
    per = [lengths[r::replicas] for r in range(replicas)]
    results = [simulate_replica(step, x, max_batch, workload.prompt_len, spec) for x in per[:1]]
    # replicas see statistically identical shares; simulate the first and the longest-tail one
    worst = max(range(replicas), key=lambda r: float(per[r].max()) if len(per[r]) else 0.0)
    if worst != 0:
        results.append(simulate_replica(step, per[worst], max_batch, workload.prompt_len, spec))
    slowest = max(results, key=lambda r: r["time"])
    return {
        "gen_s": slowest["time"],
        "iterations": slowest["iterations"],
        "trace": slowest["trace"],
        "tokens": float(lengths.sum()),
        "mean_len": float(lengths.mean()),
    }
