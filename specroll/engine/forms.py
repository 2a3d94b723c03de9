"""Proposal forms: how a budget the depth policy chose is filled, for a drafter that can
fill it in more than one way (`Drafter.forms`: the combined drafter, `drafters.combined`).

* "merged": one tree of history's and the draft network's candidates;
* "history": history's candidates alone, the network's forwards skipped;
* "chain": at a budget of k <= `CHAIN_UP_TO`, the network's *sampled* chain.

This is part of the depth policy's one decision, not a second controller: each policy
(`engine.depth`) holds a `FormChoice` as `forms`, the engine asks it once the budget is
set, and it weighs the same quantity the depth is chosen on, emitted tokens per second
of an iteration:

* merged or history? The network pays exactly when tokens / period >= (tokens - gain) /
  (period - cost), i.e. while the share of a tree iteration's tokens per row that the
  network's candidates alone brought (gain / tokens) is at least the share of the
  iteration its forwards took (cost / period); otherwise history alone, with the
  network run anyway every `PROBE_EVERY` such iterations to measure it again;
* chain or tree at a small budget? The one with more tokens per row per second at that
  budget m: tokens over the seconds of an iteration drafting it (its own proposal plus
  the rest of a small-budget iteration, which both share: the chain runs the network once
  per token, a history tree builds a trie on the host). Tokens alone until both are
  timed; each kind tried first while unmeasured; the loser probed every `PROBE_EVERY`
  small iterations. A verified tree tells what every smaller budget would have emitted
  (`engine.depth`, **Trees**), so both kinds' tokens at m come from the per-position /
  per-node counts the depth policy learns from: 1 + sum_{i<m} counts[i] / rows.

Every figure is an exponential moving average decayed by `DECAY` per report (the policy
and the draft change), the first value taken as it is. Seconds inside a proposal (the
network's feed and forwards) come from the drafter (`FormReport`); the proposal's and
the rest of the iteration's, from the engine. The state is saved with a run's drafter
state (`rl.rollout.local`), so a resumed run fills budgets as the interrupted one would.
"""

from __future__ import annotations

import time

from specroll.drafters.base import FormReport

FORMS = ("merged", "history", "chain")
"""The forms a drafter with `Drafter.forms` can make (module docstring)."""
DECAY = 0.99
"""Decay per report of every figure here."""
PROBE_EVERY = 16
"""While the losing choice is skipped (the network: it cost more of an iteration than it
brought of its tokens; the chain or the tree at a small budget: fewer tokens per second),
take it anyway every this many iterations to measure it again."""
CHAIN_UP_TO = 2
"""Budgets of at most this many nodes may draft the network's sampled chain instead,
while it measures more tokens per row per second there than the tree (the q-ratio test
keeps more of a draft than deterministic candidates do: tau(1) 1.34 against 1.26,
SmolLM2 math at T = 1, batch 32, one epoch; but each of its tokens costs a network
forward, and where history predicts well its top candidates keep more)."""
KINDS = ("chain", "tree")
"""What a small budget's tokens and seconds are kept for (merged and history: a tree)."""


def ema(old: float, new: float, decay: float = DECAY) -> float:
    """Exponential moving average (the first value taken as it is)."""
    return new if old == 0 else decay * old + (1 - decay) * new


class FormChoice:
    """The running figures of the proposal forms and the choice between them (module
    docstring). Per iteration: `choose`, then `counted` (from the depth policy's
    `observe_counts`) and `observe`; `restart` per generate call."""

    def __init__(self) -> None:
        # is the network worth its forwards? decayed per-iteration figures: tokens per
        # row its candidates alone brought, tokens per row, its seconds, the iteration's
        self.gain = self.tokens = self.cost = self.period = 0.0
        self._last_t: float | None = None
        self._skipped = 0  # tree iterations the network was skipped in (the probe clock)
        self._skips = 0  # ... after this iteration's choice, if some row could draft
        # small budgets: decayed tokens per row the chain / the tree gave at budget m
        # (index m - 1), their proposals' seconds and the rest of such an iteration's
        self.small = {kind: [0.0] * CHAIN_UP_TO for kind in KINDS}
        self.small_s = {"chain": 0.0, "tree": 0.0, "rest": 0.0}
        self._small_iters = 0
        self.feed_s = 0.0
        """Decayed seconds of feeding the network one iteration's pairs."""
        self._asked: tuple[str, int] | None = None  # this iteration's (kind, budget)

    # choosing ---------------------------------------------------------------------------
    def restart(self) -> None:
        """A new generate call: the time until the next tree is not an iteration."""
        self._last_t = None

    def choose(self, k: int) -> str:
        """The form that fills a budget of k >= 1 this iteration."""
        if k <= CHAIN_UP_TO and self._chain_pays(k):
            form = "chain"
        else:
            now = time.perf_counter()  # one tree iteration since the last one began
            if self._last_t is not None:
                self.period = ema(self.period, now - self._last_t)
            self._last_t = now
            form = "merged" if self._network_pays() else "history"
        self._asked = ("chain" if form == "chain" else "tree", k)
        return form

    def _network_pays(self) -> bool:
        """Merged rather than history alone? The probe clock moves in `observe`, and only
        for an iteration in which some row could draft (`FormReport.room`): one in which
        none could says nothing of the network."""
        self._skips = self._skipped
        if self.period <= 0 or self.tokens <= 0:
            return True
        if self.gain / self.tokens >= self.cost / self.period:
            self._skips = 0
            return True
        self._skips += 1
        return self._skips % PROBE_EVERY == 0

    def _chain_pays(self, k: int) -> bool:
        chain, tree = self.small["chain"][k - 1], self.small["tree"][k - 1]
        if chain == 0 or tree == 0:
            return chain == 0
        t = self.small_s
        if t["chain"] > 0 and t["tree"] > 0:  # per second: the iteration both kinds share
            chain, tree = chain / (t["rest"] + t["chain"]), tree / (t["rest"] + t["tree"])
        self._small_iters += 1
        probe = self._small_iters % PROBE_EVERY == 0
        return (chain > tree) != probe

    # learning ---------------------------------------------------------------------------
    def counted(self, rows: int, accepted: list[int]) -> None:
        """After verification of this iteration's proposal: per draft position (a chain)
        or node (a tree), the rows that accepted it → tokens per row at each budget m up
        to `CHAIN_UP_TO` (module docstring)."""
        if self._asked is None or rows <= 0:
            return
        kind, k = self._asked
        total = 1.0
        for m in range(1, min(CHAIN_UP_TO, k, len(accepted)) + 1):
            total += accepted[m - 1] / rows
            self.small[kind][m - 1] = ema(self.small[kind][m - 1], total)

    def observe(self, report: FormReport | None, proposing: float, rest: float) -> None:
        """The end of an iteration that asked `choose`: the drafter's `report`, the
        seconds of its proposal and of the rest of the iteration (verification, commit)."""
        if self._asked is None:
            return
        kind, k = self._asked
        self._asked = None
        report = report or FormReport()
        if report.room and kind == "tree":
            self._skipped = self._skips
        uncharged = 0.0  # a feed's seconds above what is charged for it (`_charged`)
        if report.feed is not None:
            uncharged = report.feed - self._charged(report.feed, report.steady)
        if report.network is not None:
            self.cost = ema(self.cost, report.network - uncharged)
        if k <= CHAIN_UP_TO:
            self.small_s[kind] = ema(self.small_s[kind], proposing - uncharged)
            self.small_s["rest"] = ema(self.small_s["rest"], rest)
        if report.tokens is not None:
            self.tokens = ema(self.tokens, report.tokens)
            if report.gain is not None:
                self.gain = ema(self.gain, report.gain)

    def _charged(self, seconds: float, steady: bool) -> float:
        """Feeding the network took `seconds`; `steady`: it fed at most one iteration's
        pairs → the seconds to charge. The network is fed lazily, so after iterations
        that skipped it one forward runs every pair since — whole prompts, at first.
        Charged to the proposal, that one-off would price the network at what it costs
        when it is *not* used, and keep it unused; so only steady feeds are timed (until
        one is, a feed is charged as it came)."""
        if steady:
            self.feed_s = ema(self.feed_s, seconds)
        return self.feed_s if self.feed_s > 0 else seconds

    # checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "network": [self.gain, self.tokens, self.cost, self.period, self._skipped],
            "small": {kind: list(v) for kind, v in self.small.items()},
            "small_s": dict(self.small_s),
            "feed_s": self.feed_s,
            "small_iters": self._small_iters,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict` (also a combined drafter's state from before the forms
        moved here, which held these keys)."""
        gain, tokens, cost, period, skipped = state["network"]
        self.gain, self.tokens, self.cost, self.period = map(float, (gain, tokens, cost, period))
        self._skipped = int(skipped)
        n = CHAIN_UP_TO
        if "small" in state:  # checkpoints before the measured chain/tree choice lack it
            small = state["small"]
            self.small = {k: [float(x) for x in (list(small[k]) + [0.0] * n)[:n]] for k in KINDS}
            self._small_iters = int(state["small_iters"])
        if "small_s" in state:  # ... and before it was timed
            self.small_s = {k: float(state["small_s"][k]) for k in (*KINDS, "rest")}
            self.feed_s = float(state.get("feed_s", 0.0))  # timed since small_s
