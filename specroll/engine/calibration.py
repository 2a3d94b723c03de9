"""Time calibration: what an iteration at depth k really costs, the profile corrected by
the iteration times the engine measures.

A profile (`engine.costmodel`) can be wrong by any factor (measured on a busy machine,
another thread count, stale), and a wrong one alone would keep the depth policy in a
losing k. So every iteration's wall time is compared with the profile's prediction, and
the ratio measured / predicted is kept per (k, batch-size octave) as the median of its
last `WINDOW` iterations; time(B, k, ctx) = profile(B, k, ctx) x that ratio. Once plain
decoding and a depth have both run at a batch size, the choice between them rests on
measured times (the profile only interpolates within an octave and across contexts); a
depth not yet run there borrows its ratio from depths run there (interpolated in k;
beyond the deepest one measured, not more optimistic than it or than the nearest
octave's, shrunk by `BORROW` per octave, unless the measured times' slope in k says it
is cheaper: see `times`).

**Stale profiles.** After its first `CHECK_AFTER` iterations the calibration compares the
profile with the measurements (median ratio overall and per k); outside `STALE_BAND` it
warns and calls the cost model's `mark_stale` (a cached profile is then measured again
by the next run; see `specroll.engine.profile.cached_profile`). The online correction
keeps the current run safe in the meantime.

Kept apart from the acceptance estimate (`engine.acceptance`): it learns from every
iteration, drafting or not, and knows nothing of what was accepted.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import deque
from collections.abc import Iterable

from specroll.engine.acceptance import octave

WINDOW = 16
"""Measured/predicted time ratios kept per (k, batch octave); their median is used."""
BORROW = 0.5
"""Weight per octave of distance of a time ratio borrowed from another batch octave."""
CHECK_AFTER = 48
"""Iterations after which the profile is checked against the measurements."""
STALE_BAND = (0.67, 1.5)
"""Median measured/predicted ratios outside this band mark the profile stale."""


def _median(xs) -> float:
    """statistics.median of a short sequence, without its overhead (every iteration)."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


class TimeCalibration:
    """Measured / predicted iteration-time ratios per (batch octave, k) (module
    docstring)."""

    def __init__(self, cost, k_max: int, tree: bool) -> None:
        self.cost, self.k_max, self.tree = cost, k_max, tree
        self._ratios: dict[tuple[int, int], deque] = {}  # (octave, k) -> measured/predicted
        self._logr: dict[tuple[int, int], float] = {}  # (octave, k) -> log median of those
        self._first: list[tuple[int, float]] = []  # (k, ratio) of the first iterations
        self._checked = False
        self.disagreement: dict | None = None
        """Set when the profile failed its check: the median ratios that failed it."""

    def state_dict(self) -> dict:
        """The measured ratios as plain lists (a checkpoint)."""
        return {
            "ratios": [[b, k, list(r)] for (b, k), r in self._ratios.items()],
            "first": [list(x) for x in self._first],
            "checked": self._checked,
            "disagreement": self.disagreement,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`."""
        self._ratios, self._logr = {}, {}
        for b, k, rs in state["ratios"]:
            key = (int(b), int(k))
            self._ratios[key] = deque((float(r) for r in rs), maxlen=WINDOW)
            self._logr[key] = math.log(_median(self._ratios[key]))
        self._first = [(int(k), float(r)) for k, r in state["first"]]
        self._checked = bool(state["checked"])
        self.disagreement = state["disagreement"]

    def predict(self, B: int, k: int, ctx: float) -> float:
        """The profile's iteration time (a tree's k nodes cost more than k drafts)."""
        if self.tree:
            return self.cost.iteration(B, k, ctx, tree=True)
        return self.cost.iteration(B, k, ctx)

    def measured(self, b: int, k: int) -> bool:
        """Has depth k run at batch octave b?"""
        return (b, k) in self._logr

    def observe(self, batch_size: int, k: int, ctx: float, seconds: float) -> bool:
        """Wall time of one engine iteration over `batch_size` rows drafting k → whether
        it was recorded (a non-positive time or prediction, or a k out of range, is not)."""
        pred = self.predict(batch_size, k, ctx)
        if pred <= 0 or seconds <= 0 or not 0 <= k <= self.k_max:
            return False
        key = (octave(batch_size), k)
        ratios = self._ratios.get(key)
        if ratios is None:
            ratios = self._ratios[key] = deque(maxlen=WINDOW)
        ratios.append(seconds / pred)
        self._logr[key] = math.log(_median(ratios))
        if not self._checked:  # the first iterations' ratios: the profile's check
            self._first.append((k, seconds / pred))
            if len(self._first) >= CHECK_AFTER:
                self._check_profile()
        return True

    def _check_profile(self) -> None:
        self._checked = True
        lo, hi = STALE_BAND
        groups = {"all": [r for _, r in self._first]}
        for k in sorted({k for k, _ in self._first}):
            rs = [r for kk, r in self._first if kk == k]
            if len(rs) >= 4:
                groups[f"k={k}"] = rs
        medians = {g: round(statistics.median(rs), 3) for g, rs in groups.items()}
        bad = {g: m for g, m in medians.items() if not lo <= m <= hi}
        if not bad:
            return
        self.disagreement = medians
        meta = getattr(self.cost, "meta", {})
        if meta.get("quick"):
            return  # a coarse prior is expected to be off: correcting it is the plan
        where = meta.get("cache_path", "")
        mark = getattr(self.cost, "mark_stale", None)
        reason = (
            f"measured / predicted iteration time over the first {len(self._first)} "
            f"iterations: {medians} (outside [{lo}, {hi}])"
        )
        if mark is not None:
            mark(reason)
        warnings.warn(
            f"the hardware profile disagrees with this run's iteration times: {reason}; "
            "adaptive depth corrects it online"
            + (f"; {where} will be measured again by the next run" if where else ""),
            RuntimeWarning,
            stacklevel=4,
        )

    def _relative(self, b: int) -> list[float | None] | None:
        """[k_max + 1] log(ratio at k / ratio at 0) in octave b from its own measurements,
        interpolated in k between measured depths, None beyond the deepest; None without
        plain decoding and a depth measured there."""
        logr = self._logr
        e0 = logr.get((b, 0))
        if e0 is None:
            return None
        known = [(j, logr[b, j] - e0) for j in range(self.k_max + 1) if (b, j) in logr]
        if len(known) < 2:
            return None
        out: list[float | None] = [None] * (self.k_max + 1)
        for (lo, dlo), (hi, dhi) in zip(known, known[1:], strict=False):
            for k in range(lo, hi + 1):
                out[k] = dlo + (dhi - dlo) * (k - lo) / (hi - lo)
        return out

    def corrections(self, b: int, ks: Iterable[int]) -> dict[int, float]:
        """log(measured / predicted) time ratios at octave b, for the depths ks only (the
        policy's hot path)."""
        logr = self._logr
        own = {k: logr.get((b, k)) for k in ks}
        if all(v is not None for v in own.values()):
            return own
        octaves = sorted({o for o, _ in logr}, key=lambda o: (abs(o - b), o))
        e0 = next((logr[o, 0] for o in octaves if (o, 0) in logr), 0.0)
        rel = self._relative(b)
        deepest = None  # relative ratio of the deepest depth measured here
        if rel is not None:
            deepest = next(v for v in reversed(rel) if v is not None)
        other = next(  # the nearest other octave with plain and a depth measured
            ((o, r) for o in octaves if o != b and (r := self._relative(o)) is not None),
            None,
        )
        out = {}
        for k in ks:
            if own[k] is not None:
                out[k] = own[k]
                continue
            if rel is not None and rel[k] is not None:
                out[k] = e0 + rel[k]
                continue
            cands = [] if deepest is None else [deepest]
            if other is not None:
                o, r = other
                v = r[k] if r[k] is not None else next(x for x in reversed(r) if x is not None)
                cands.append(v * BORROW ** abs(o - b))
            # beyond the deepest depth measured here: not more optimistic than it
            out[k] = e0 + (max(cands) if cands else 0.0)
        return out

    def times(self, B: int, ctx: float, ks: Iterable[int]) -> dict[int, float]:
        """Expected seconds of an iteration at each of the depths ks: the profile times
        its measured correction. Beyond the deepest depth measured at this octave, the
        lower of two extrapolations: the deepest one's ratio (the profile's shape) and
        the measured times' slope over the two deepest (a profile whose per-depth cost is
        wrong has the wrong shape; being optimistic there costs one probe, one step
        deeper, which then measures it). Only the depths asked for (a tree of 32 nodes is
        choosing among 7 budgets, not 33)."""
        b = octave(B)
        measured = sorted(k for o, k in self._logr if o == b)
        slope_from = measured[-2:] if len(measured) >= 2 and measured[0] == 0 else []
        need = sorted({*ks, *slope_from})
        corr = self.corrections(b, need)
        t = {k: self.predict(B, k, ctx) * math.exp(corr[k]) for k in need}
        if slope_from:
            k1, k2 = slope_from
            slope = max(t[k2] - t[k1], 0.0) / (k2 - k1)
            for k in ks:
                if k > k2:
                    t[k] = min(t[k], t[k2] + slope * (k - k2))
        return t

    def report(self) -> dict:
        """Median measured/predicted time ratio per batch octave and depth (for reports)."""
        out: dict[str, dict[int, float]] = {}
        for (b, k), r in sorted(self._logr.items()):
            out.setdefault(f"B{1 << b}-{(2 << b) - 1}", {})[k] = round(math.exp(r), 3)
        return out
