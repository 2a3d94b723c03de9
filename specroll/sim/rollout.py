"""Rollout simulation: continuous batching with a shrinking batch, with or without drafts.

One generation replica holds at most `max_batch` sequences; finished ones free their slot
for queued ones (each admission costs a prefill), so the batch stays full until the
queue empties and then shrinks to the longest sample — the tail that dominates RL
rollouts (Seer: the last 10% of requests can take half the time). Each iteration the
depth policy picks k for the live batch; a row then advances by the expected emitted
tokens tau(k) = 1 + sum_i prod_{j<=i} alpha_j (mean-field: rows advance by the
expectation, not a sampled count). Time per iteration comes from any step model with
the `iteration(B, k, ctx)` interface (analytic or measured).

A tree drafter (the history drafter, or one merged with EAGLE-3) has no per-position
alphas: its acceptance is measured as tokens per iteration at a few node budgets n and
given as a table (`Speculation.taus`); what its iterations cost beyond a chain's is a
`TreeCost` (verify overhead of tree attention, host-side drafting, a drafter network).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


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

    def __post_init__(self) -> None:
        for name in ("prompts", "samples", "prompt_len", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload.{name} must be >= 1, got {getattr(self, name)}")
        if self.mean_len <= 0 or self.sigma < 0:
            raise ValueError(
                f"workload.mean_len must be > 0 and sigma >= 0, got {self.mean_len}, {self.sigma}"
            )
        if self.lengths is not None and (not self.lengths or min(self.lengths) < 1):
            raise ValueError("workload.lengths must be a non-empty list of positive lengths")

    def draw(self) -> np.ndarray:
        """[prompts * samples] response lengths."""
        if self.lengths is not None:
            return np.array(self.lengths, dtype=np.float64)
        n = self.prompts * self.samples
        mu = math.log(self.mean_len) - self.sigma**2 / 2
        x = np.exp(mu + self.sigma * standard_normal(n, self.seed))
        return np.clip(x, 1, self.max_len).round()


def standard_normal(n: int, seed: int) -> np.ndarray:
    """[n] standard normal draws: the stream `torch.randn(n, dtype=float64)` gives after
    `manual_seed(seed)` (mt19937, 53-bit uniforms, Box-Muller in blocks of 16), without
    torch. The simulator drew its workloads with torch before it lost that dependency;
    keeping the stream keeps every figure, and the paper calibration fitted on them, as
    they were (tests/test_sim.py checks it against torch to an ulp)."""
    mt = np.random.RandomState(seed & 0xFFFFFFFF)  # mt19937 seeded as torch seeds it

    def uniforms(m: int) -> np.ndarray:  # [m] in [0, 1): torch's random64 -> 53 bits
        raw = mt.randint(0, 2**32, size=2 * m, dtype=np.uint32).astype(np.uint64)
        bits = (raw[0::2] << np.uint64(32)) | raw[1::2]
        return (bits & np.uint64((1 << 53) - 1)).astype(np.float64) * 2.0**-53

    def box_muller(u: np.ndarray) -> np.ndarray:  # [16] uniforms -> [16] normals
        r, theta = np.sqrt(-2.0 * np.log(1.0 - u[:8])), 2.0 * math.pi * u[8:]
        return np.concatenate([r * np.cos(theta), r * np.sin(theta)])

    if n < 16:  # torch's one-at-a-time path: pairs (u1, u2), the sine kept for the next
        u = uniforms(2 * ((n + 1) // 2))
        r, theta = np.sqrt(-2.0 * np.log1p(-u[1::2])), 2.0 * math.pi * u[0::2]
        return np.stack([r * np.cos(theta), r * np.sin(theta)], axis=1).reshape(-1)[:n]
    z = uniforms(n)
    for i in range(0, n - 15, 16):
        z[i : i + 16] = box_muller(z[i : i + 16])
    if n % 16:  # the last 16 are drawn afresh
        z[n - 16 :] = box_muller(uniforms(16))
    return z


def _solve(f: Callable[[float], float], target: float) -> float:
    """The alpha in [0, 1] with f(alpha) = target, for f increasing (bisection; 0 or 1
    when target is out of f's range)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if f(a) < target else (lo, a)
    return lo


@dataclass
class TreeCost:
    """What an iteration verifying n tree nodes per row costs (n = 0: plain decoding):
    `tree_overhead` x the target forward of a chain of n + 1 tokens per row, plus the
    tree path's fixed time per iteration, plus the host's drafting time per row, plus
    the step model's drafter time for a chain of min(n, model_depth) tokens, plus the
    step model's verification overhead."""

    tree_overhead: float = 1.0
    """Verify forward of n tree nodes over a chain forward of n + 1 tokens per row: the
    tree mask and the walk (measured 1.1-1.6 on an H200 in bf16 at SmolLM2-135M shapes,
    `benchmarks/tree_verify_cost.py`); 1.0 = costs what a chain does."""
    fixed_s: float = 0.0
    """Seconds per iteration the tree path adds whatever its size (specroll's engine on an
    H200 at Qwen3-8B shapes: ~20 ms over a chain of the same width at batch >= 8, its
    per-depth host syncs; `benchmarks/tree_verify_cost.py --chains`); 0 = an
    implementation without them."""
    host_draft_s: float = 0.0
    """Host-side drafting seconds per row per iteration (model-free drafters: the history
    drafter is Python over lists, ~0.2-0.7 ms on a CPU); the device waits for it."""
    model_depth: int = 0
    """Drafter-network forwards per iteration (EAGLE-3 beside the tree): the step model's
    draft time for min(n, model_depth) tokens; 0 = no network."""

    def __post_init__(self) -> None:
        if not self.tree_overhead > 0:
            raise ValueError(f"tree_cost.tree_overhead must be > 0, got {self.tree_overhead}")
        if self.fixed_s < 0:
            raise ValueError(f"tree_cost.fixed_s must be >= 0, got {self.fixed_s}")
        if self.host_draft_s < 0:
            raise ValueError(f"tree_cost.host_draft_s must be >= 0, got {self.host_draft_s}")
        if self.model_depth < 0:
            raise ValueError(f"tree_cost.model_depth must be >= 0, got {self.model_depth}")


@dataclass
class Speculation:
    """How the simulated engine drafts."""

    k: int = 0
    """Draft depth (fixed), or the deepest one considered (adaptive); 0 = plain decoding.
    With `taus`: the node budget (fixed), or the largest one considered (adaptive)."""
    alphas: list[float] = field(default_factory=list)
    """Conditional per-position acceptance alpha_1..alpha_k (see tau)."""
    adaptive: bool = False
    """Pick k in 0..k per iteration to maximise tokens/s (else always k); with `taus`,
    only among the measured node budgets (the grid the engine's policy chooses from)."""
    max_batch: int = 1 << 30
    """Fixed depth only: speculate while at most this many rows are active (else k = 0)."""
    taus: dict[int, float] | None = None
    """Measured expected tokens per iteration at node budgets n, increasing in n (e.g.
    {0: 1.0, 1: 1.3, 4: 1.6, 16: 1.95, 64: 2.1}); used instead of `alphas`, since a tree
    drafter has no per-position acceptance. tau(0) = 1 is added if absent."""
    tree_cost: TreeCost | None = None
    """What n tree nodes cost to draft and verify; None = a chain of n draft tokens
    (the step model's `iteration`). Needs `taus`."""

    def __post_init__(self) -> None:
        if self.taus is not None:
            self._check_taus()
        if self.k < 0:
            raise ValueError(f"speculation.k must be >= 0, got {self.k}")
        if self.tree_cost is not None and self.taus is None:
            raise ValueError("speculation.tree_cost needs speculation.taus (measured tau(n))")

    def _check_taus(self) -> None:
        """Validate and normalise the table (tau(0) = 1 added)."""
        if self.alphas:
            raise ValueError("give speculation.alphas or speculation.taus, not both")
        sizes = list(self.taus)
        if not sizes:
            raise ValueError("speculation.taus must hold at least one measured size")
        if any(not isinstance(n, int) or n < 0 for n in sizes):
            raise ValueError(f"speculation.taus sizes must be integers >= 0, got {sizes}")
        if sizes != sorted(set(sizes)):
            raise ValueError(f"speculation.taus sizes must increase, got {sizes}")
        if self.taus.get(0, 1.0) != 1.0:
            raise ValueError(f"speculation.taus[0] must be 1.0 (plain), got {self.taus[0]}")
        taus = {0: 1.0, **{n: float(t) for n, t in self.taus.items()}}
        for a, b in zip(sizes, sizes[1:], strict=False):
            if taus[b] < taus[a]:
                raise ValueError(
                    f"speculation.taus must not decrease with the node budget, got "
                    f"tau({a}) = {taus[a]} > tau({b}) = {taus[b]}"
                )
        bad = {n: t for n, t in taus.items() if not 1.0 <= t <= n + 1}
        if bad:
            raise ValueError(
                f"speculation.taus values must be in [1, n + 1] (tokens per iteration of n "
                f"nodes), got {bad}"
            )
        self.taus = taus

    @staticmethod
    def measured(
        taus: dict[int, float], tree_cost: TreeCost | None = None, adaptive: bool = True
    ) -> Speculation:
        """A drafter known by its measured tau(n) (largest budget = the measured one)."""
        k = max(taus, default=0)
        return Speculation(k=k, adaptive=adaptive, taus=taus, tree_cost=tree_cost)

    def depths(self, B: int) -> range | list[int]:
        """The depths an iteration over B active rows may choose from."""
        if self.adaptive:
            if self.taus is not None:
                return [n for n in self.taus if n <= self.k]
            return range(self.k + 1)
        return [self.k if self.max_batch >= B else 0]

    def time(self, step, B: float, n: int, ctx: float) -> float:
        """Seconds of one iteration over B rows with n draft tokens (chain) or n tree
        nodes (`tree_cost`) per row."""
        c = self.tree_cost
        if c is None or n == 0:
            return step.iteration(B, n, ctx)
        verify = c.tree_overhead * step.target(B, n + 1, ctx) + step.overhead(B, n)
        draft = step.draft(B, min(n, c.model_depth)) + c.host_draft_s * B
        return verify + c.fixed_s + draft

    def tau(self, k: int) -> float:
        """Expected tokens one iteration at depth (or node budget) k emits per row. From a
        table: piecewise linear in log2(n + 1) between measured budgets, and never more
        than the largest one measured (a bigger tree is not assumed to help)."""
        if self.taus is not None:
            sizes = list(self.taus)
            if k >= sizes[-1]:
                return self.taus[sizes[-1]]
            i = bisect.bisect_right(sizes, k)
            lo, hi = sizes[i - 1], sizes[i]
            w = (math.log2(k + 1) - math.log2(lo + 1)) / (math.log2(hi + 1) - math.log2(lo + 1))
            return self.taus[lo] + w * (self.taus[hi] - self.taus[lo])
        out, run = 1.0, 1.0
        for a in self.alphas[:k]:
            run *= a
            out += run
        return out

    @staticmethod
    def padded(alphas: list[float], k: int) -> Speculation:
        """Depth k with `alphas` cut to k positions, or extended with its last value."""
        return Speculation(k=k, alphas=(list(alphas) + [alphas[-1]] * k)[:k])

    @staticmethod
    def from_acceptance_length(al: float, k: int) -> Speculation:
        """Constant alpha with 1 + a + ... + a^k = al (how papers report acceptance)."""
        return Speculation(k=k, alphas=[_solve(lambda a: sum(a**i for i in range(k + 1)), al)] * k)

    @staticmethod
    def from_acceptance_lengths(als: dict[int, float], k: int | None = None) -> Speculation:
        """Piecewise-constant alphas reproducing acceptance lengths measured at several k
        (e.g. {3: 3.32, 5: 4.35, 7: 5.06}): positions up to the first k share one alpha,
        each further segment its own, so every listed AL is matched exactly."""
        alphas: list[float] = []
        for kk in sorted(als):
            base = Speculation(len(alphas), list(alphas))
            reach = base.tau(len(alphas)) - base.tau(len(alphas) - 1) if alphas else 1.0
            n, target = kk - len(alphas), als[kk] - base.tau(len(alphas))
            if n < 1 or target <= 0:
                raise ValueError(f"acceptance lengths must grow with k, got {als}")
            # reach * (a + a^2 + ... + a^n) = target
            f = lambda a, r=reach, n=n: r * sum(a**i for i in range(1, n + 1))  # noqa: E731
            alphas += [_solve(f, target)] * n
        kk = max(als) if k is None else k
        return Speculation.padded(alphas, kk)


def simulate_replica(
    step,
    lengths: np.ndarray,
    max_batch: int,
    prompt_len: float,
    spec: Speculation,
    max_run: int = 32,
) -> dict:
    """Generation time of one replica for `lengths` (its share of the samples).

    Mirrors the engine's loop: an iteration either admits queued requests into free
    slots (one batched prefill, which also samples their first token) or advances every
    active row by one decode / speculative step; a row leaves when it has its tokens.
    Requests are admitted in order, so `lengths` is also the queue. Runs of iterations
    with the same rows are advanced together (at most `max_run`; the adaptive depth is
    chosen once per run), so the cost is per finishing row, not per token.
    """
    lengths = np.asarray(lengths, dtype=np.float64)  # [n]
    n = len(lengths)
    remaining = lengths.copy()
    done = np.zeros_like(lengths)  # [n] tokens generated so far
    active = np.zeros(n, dtype=bool)
    admitted, t, iters = 0, 0.0, 0
    trace: list[tuple[float, int, int]] = []
    depth = [0] * (spec.k + 1)
    tau = [spec.tau(k) for k in range(spec.k + 1)]
    while admitted < n or bool(active.any()):
        B = int(active.sum())
        if admitted < n and max_batch > B:
            new = slice(admitted, min(n, admitted + max_batch - B))
            admitted = new.stop
            active[new] = True
            remaining[new] -= 1
            done[new] += 1
            t += step.prefill(new.stop - new.start, prompt_len)
        else:
            # until the next row finishes nothing but the context changes: advance m
            # iterations at once, timed at their middle context (exact for step models
            # linear in the context, e.g. the fitted CostModel)
            ctx = prompt_len + float(done[active].mean())
            k = max(spec.depths(B), key=lambda kk: tau[kk] / spec.time(step, B, kk, ctx))
            m = max(1, min(max_run, math.ceil(float(remaining[active].min()) / tau[k])))
            remaining[active] -= tau[k] * m
            done[active] += tau[k] * m
            t += m * spec.time(step, B, k, ctx + tau[k] * (m - 1) / 2)
            iters += m
            depth[k] += m
            trace.append((t, B, k))
        active &= remaining > 0
    if len(trace) > 400:  # keep the plot data small: every n-th point and the last
        trace = trace[:: len(trace) // 400 + 1] + trace[-1:]
    return {"time": t, "iterations": iters, "depth_hist": depth, "trace": trace}


def simulate_rollout(
    step,
    lengths: np.ndarray,
    replicas: int,
    max_batch: int,
    prompt_len: float,
    spec: Speculation,
) -> dict:
    """Sync rollout of `lengths` dealt over `replicas` replicas: the step waits for the
    slowest. Replicas see statistically alike shares, so only the first and the one
    holding the longest sample (the tail) are simulated."""
    lengths = np.asarray(lengths, dtype=np.float64)  # [n]
    per = [lengths[r::replicas] for r in range(min(replicas, len(lengths)))]
    pick = {0, max(range(len(per)), key=lambda r: float(per[r].max()))}
    runs = [simulate_replica(step, per[r], max_batch, prompt_len, spec) for r in sorted(pick)]
    slowest = max(runs, key=lambda r: r["time"])
    return {"gen_s": slowest.pop("time"), **slowest}
