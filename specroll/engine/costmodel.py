"""Step-time cost model: what one engine iteration costs, fitted to measurements.

It lives beside the engine because the engine is what it describes and what uses it at
run time (`engine.depth`, `engine.profile`); the simulator (`specroll simulate
--profile`) loads a measured one through the same class.

A decode/verify forward over B rows adding q tokens each at context c processes N = B*q
tokens. Its time is modelled as

    T(B, q, c) = fixed + per_token * max(N, knee) + kv * B * c + attn * N * c

* `fixed`: per-forward overhead (kernel launches, Python, norms) independent of size;
* `per_token * max(N, knee)`: the linear layers. Below the knee the weights are read
  once whatever N is (memory bound, flat); above it the cost grows with N (compute
  bound). The knee is where the machine's FLOP/byte ratio meets the model's;
* `kv * B * c`: reading the KV cache — once per row, shared by its q queries (which
  is why verifying k+1 tokens at long context costs less than k+1 forwards: MagicDec);
* `attn * N * c`: attention arithmetic (each of the N queries scores c keys).

The drafter costs, per speculative iteration, `draft_fixed + draft_per_row * B` (feeding
the verified tokens' features back) plus, per draft token, `draft_step +
draft_step_per_row * B`; the verifier / sampling / bookkeeping of an iteration costs
`overhead_fixed + overhead_per_token * B * (k + 1)`. Verifying a draft *tree* of k nodes
per row costs the chain's forward over k + 1 tokens plus `tree_fixed + tree_per_token *
B * (k + 1)` (the tree mask, the walk down the tree, moving the accepted path's keys and
values; measured by timing engine iterations over trees against the fitted chain
prediction). All coefficients are fitted by least
squares to `specroll bench profile` measurements and saved as a hardware profile (JSON),
with the fit error.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from specroll.inputs import printable, read_json, shown

MAX_COEFFICIENT = 1e4
"""Largest coefficient a profile may state (seconds per forward, per token, per key):
a real one is below a second; far beyond, the controller's arithmetic overflows."""
MAX_KNEE = 1e9
"""Largest knee (tokens per forward) a profile may state."""


@dataclass
class CostModel:
    """Fitted per-iteration times (seconds) of one model (+ drafter) on one machine."""

    fixed: float = 0.0
    per_token: float = 0.0
    knee: float = 1.0
    kv: float = 0.0
    attn: float = 0.0
    draft_fixed: float = 0.0
    draft_per_row: float = 0.0
    draft_step: float = 0.0
    draft_step_per_row: float = 0.0
    overhead_fixed: float = 0.0
    overhead_per_token: float = 0.0
    tree_fixed: float = 0.0
    tree_per_token: float = 0.0
    meta: dict = field(default_factory=dict)
    """Where and how it was measured (machine, model, threads, fit error)."""

    def target(self, B: float, q: float, ctx: float) -> float:
        """Target forward adding q tokens to each of B rows at context ctx."""
        n = B * q
        kv = self.kv * B * ctx + self.attn * n * ctx
        return self.fixed + self.per_token * max(n, self.knee) + kv

    def draft(self, B: float, k: int) -> float:
        """Drafter time of one iteration proposing k tokens per row (0 when k = 0)."""
        if k == 0:
            return 0.0
        per_iter = self.draft_fixed + self.draft_per_row * B
        return per_iter + k * (self.draft_step + self.draft_step_per_row * B)

    def overhead(self, B: float, k: int) -> float:
        """Verification, sampling and bookkeeping of one iteration."""
        return self.overhead_fixed + self.overhead_per_token * B * (k + 1)

    def tree(self, B: float, k: int) -> float:
        """What verifying a tree of k nodes per row costs beyond a chain of k drafts."""
        if k == 0:
            return 0.0
        return self.tree_fixed + self.tree_per_token * B * (k + 1)

    def iteration(self, B: float, k: int, ctx: float, tree: bool = False) -> float:
        """Wall time of one engine iteration drafting k tokens per row (k = 0: plain);
        `tree`: k nodes of a draft tree."""
        t = self.target(B, k + 1, ctx) + self.draft(B, k) + self.overhead(B, k)
        return t + self.tree(B, k) if tree else t

    def prefill(self, B: float, prompt: float) -> float:
        """Prefill of B new rows of `prompt` tokens (the linear and attention terms at
        q = prompt, each query reading on average half the prompt)."""
        return self.target(B, prompt, prompt / 2)

    def save(self, path: str | Path) -> None:
        meta = {k: v for k, v in self.meta.items() if k != "cache_path"}
        tmp = Path(path).with_name(Path(path).name + ".tmp")  # atomic: never half a profile
        tmp.write_text(json.dumps(asdict(self) | {"meta": meta}, indent=2) + "\n")
        os.replace(tmp, path)

    def mark_stale(self, reason: str) -> bool:
        """Record in the cached file this profile came from (meta["cache_path"], set by
        `specroll.engine.profile.cached_profile`) that measurements contradicted it, so that
        the next run measures it again. A profile the user gave is never touched.
        Returns whether a file was marked."""
        self.meta["stale"] = reason
        path = self.meta.get("cache_path")
        if not path or not Path(path).is_file():
            return False
        try:
            raw = json.loads(Path(path).read_text())
            raw.setdefault("meta", {})["stale"] = reason
            Path(path).write_text(json.dumps(raw, indent=2) + "\n")
        except (OSError, ValueError):
            return False
        return True

    @classmethod
    def load(cls, path: str | Path, what: str = "hardware profile") -> CostModel:
        """A profile saved by `save` (or written by hand); ValueError naming the file and
        the field for anything a fitted profile cannot hold: a coefficient that is not a
        finite number in 0..MAX_COEFFICIENT (a negative or NaN one would make every depth
        look free or never worth it), a knee below 1, an unknown field."""
        p = Path(path)
        if not p.exists():
            raise ValueError(f"{what} {p} does not exist (run `specroll bench profile`)")
        raw = read_json(p, what)
        if not isinstance(raw, dict):
            raise ValueError(f"{p}: the {what} holds a {type(raw).__name__}, not a JSON object")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{p}: unknown fields {sorted(printable(u) for u in unknown)[:5]}")
        for name in COST_FIELDS:
            v = raw.get(name, 0.0)
            low = 1.0 if name == "knee" else 0.0
            top = MAX_KNEE if name == "knee" else MAX_COEFFICIENT
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= top:
                raise ValueError(
                    f"{p}: the {what}'s {name}={shown(v)} must be a finite number in "
                    f"{low:g}..{top:g}"
                )
        if not isinstance(raw.get("meta", {}), dict):
            raise ValueError(f"{p}: the {what}'s meta must be a JSON object")
        if not any(raw.get(n, 0.0) > 0 for n in ("fixed", "per_token")):
            raise ValueError(
                f"{p}: the {what} says a forward costs nothing (fixed = per_token = 0)"
            )
        return cls(**raw)


COST_FIELDS = tuple(f for f in CostModel.__dataclass_fields__ if f != "meta")
"""The fitted coefficients (every field but `meta`)."""


def _lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative-ish least squares: plain lstsq, negative coefficients clamped to 0 and
    the rest refitted (a time model with negative terms extrapolates badly)."""
    cols = list(range(X.shape[1]))
    while True:
        coef = np.linalg.lstsq(X[:, cols], y, rcond=None)[0]
        if bool((coef >= 0).all()) or len(cols) == 1:
            out = np.zeros(X.shape[1])
            out[cols] = np.maximum(coef, 0.0)
            return out
        cols = [c for c, v in zip(cols, coef.tolist(), strict=True) if v > 0]


def fit_target(points: list[dict]) -> tuple[dict, dict]:
    """Fit fixed / per_token / knee / kv / attn to points {B, q, ctx, seconds}.

    The knee is chosen on a grid (every measured N); for each, the other four are a
    linear least-squares fit on relative error (rows weighted by 1 / seconds, so small
    and large forwards count alike). Returns (coefficients, {"mape", "max_rel_err"}).
    """
    b = np.array([p["B"] for p in points], dtype=np.float64)  # [n]
    n = np.array([p["B"] * p["q"] for p in points], dtype=np.float64)
    c = np.array([p["ctx"] for p in points], dtype=np.float64)
    y = np.array([p["seconds"] for p in points], dtype=np.float64)
    best = None
    for knee in sorted(set(n.tolist())):
        X = np.stack([np.ones_like(n), np.maximum(n, knee), b * c, n * c], axis=1)  # [n, 4]
        X = X / y[:, None]
        coef = _lstsq(X, np.ones_like(y))
        pred = (X * y[:, None]) @ coef
        rel = np.abs((pred - y) / y)
        if best is None or float(rel.mean()) < best[0]:
            best = (float(rel.mean()), float(rel.max()), knee, coef)
    mape, worst, knee, coef = best
    fitted = {
        "fixed": float(coef[0]),
        "per_token": float(coef[1]),
        "knee": knee,
        "kv": float(coef[2]),
        "attn": float(coef[3]),
    }
    return fitted, {"mape": round(mape, 4), "max_rel_err": round(worst, 4)}


def fit_features(features: list[list[float]], ys: list[float]) -> tuple[list[float], float]:
    """y = sum_i c_i f_i (c_i >= 0) by relative least squares; returns (c, mape)."""
    F = np.array(features, dtype=np.float64)  # [n, f]
    y = np.array(ys, dtype=np.float64)
    coef = _lstsq(F / y[:, None], np.ones_like(y))
    pred = F @ coef
    return coef.tolist(), float(np.abs((pred - y) / y).mean())


def fit_linear(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """y = a + b x by relative least squares; returns (a, b, mape)."""
    (a, b), mape = fit_features([[1.0, x] for x in xs], ys)
    return a, b, mape
