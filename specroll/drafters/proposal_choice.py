"""Which proposal the combined drafter makes at the engine's budget: the merged tree with
or without the draft network's candidates, or — at a small budget — the network's
sampled chain.

The engine's depth policy (`engine.depth`) decides how many nodes a row gets; within
that budget this is the one controller of what fills it. The combined drafter
(`drafters.combined`) reports what it measured — the seconds between its proposals (an
iteration), of its network's forwards and feeds, of a small budget's proposal and the
rest of that iteration, and the tokens per row each kind brought — and asks:

* `network_pays`: run the network for this iteration's tree? Yes while the share of the
  tokens its candidates alone brought is at least the share of the iteration its
  forwards took (tokens per second then rise with it), and every `PROBE_EVERY` such
  iterations when not (to measure it again);
* `use_chain(k)`: draft the network's sampled chain instead of the tree at a budget of
  k <= `CHAIN_UP_TO`? Yes while it has given more tokens per row per second there than
  the tree (tokens alone until both are timed; each tried first while unmeasured; the
  loser probed every `PROBE_EVERY` small iterations).

Every figure is an exponential moving average decayed by `DECAY` per report (the policy
and the draft change), the first value taken as it is. The state belongs to the drafter
— it is saved in the drafter's checkpoint (`state_dict`) and shared by every engine
that drafts with it (a run's and its shadow's) — which is why it lives beside the
drafter, not in the per-engine depth policy.
"""

from __future__ import annotations

DECAY = 0.99
"""Decay per report of every figure here (and of the combined drafter's calibration)."""
PROBE_EVERY = 16
"""While the losing choice is skipped (the network: it cost more of an iteration than it
brought of its tokens; the chain or the tree at a small budget: fewer tokens per second),
take it anyway every this many iterations to measure it again."""
CHAIN_UP_TO = 2
"""Budgets of at most this many nodes may draft the network's *sampled* chain instead,
while it measures more tokens per row per second there than the tree (the q-ratio test
keeps more of a draft than deterministic candidates do: tau(1) 1.34 against 1.26,
SmolLM2 math at T = 1, batch 32, one epoch; but each of its tokens costs a network
forward, and where history predicts well its top candidates keep more)."""
KINDS = ("chain", "tree")
"""The proposals a small budget may make."""


def ema(old: float, new: float, decay: float = DECAY) -> float:
    """Exponential moving average (the first value taken as it is)."""
    return new if old == 0 else decay * old + (1 - decay) * new


class ProposalChoice:
    """The combined drafter's running figures and its two decisions (module docstring)."""

    def __init__(self) -> None:
        # is the network worth its forwards? decayed per-iteration figures: tokens per
        # row its candidates alone brought, tokens per row, its seconds, the iteration's
        self.gain = self.tokens = self.cost = self.period = 0.0
        self._last_t: float | None = None
        self._skipped = 0
        # small budgets: decayed tokens per row the chain / the tree gave at budget m
        # (index m - 1), and a probe clock
        self.small = {kind: [0.0] * CHAIN_UP_TO for kind in KINDS}
        # ... and their seconds: each kind's proposal, the rest of such an iteration
        self.small_s = {"chain": 0.0, "tree": 0.0, "rest": 0.0}
        self._small_iters = 0
        self.feed_s = 0.0
        """Decayed seconds of feeding the network one iteration's pairs."""

    # asking -----------------------------------------------------------------------------
    @staticmethod
    def small_budget(k: int) -> bool:
        """May a budget of k draft the chain (and is it timed as a small budget)?"""
        return 0 < k <= CHAIN_UP_TO

    def network_pays(self) -> bool:
        """Run the network for this iteration's tree (module docstring)?"""
        if self.period <= 0 or self.tokens <= 0:
            return True
        if self.gain / self.tokens >= self.cost / self.period:
            self._skipped = 0
            return True
        self._skipped += 1
        return self._skipped % PROBE_EVERY == 0

    def use_chain(self, k: int) -> bool:
        """Draft the sampled chain at a budget of k <= `CHAIN_UP_TO` (module docstring)?"""
        chain, tree = self.small["chain"][k - 1], self.small["tree"][k - 1]
        if chain == 0 or tree == 0:
            return chain == 0
        t = self.small_s
        if t["chain"] > 0 and t["tree"] > 0:  # per second: the iteration both kinds share
            chain, tree = chain / (t["rest"] + t["chain"]), tree / (t["rest"] + t["tree"])
        self._small_iters += 1
        probe = self._small_iters % PROBE_EVERY == 0
        return (chain > tree) != probe

    # reporting --------------------------------------------------------------------------
    def restart(self) -> None:
        """A new generate call: the time until the next proposal is not an iteration."""
        self._last_t = None

    def tree_started(self, now: float) -> None:
        """A tree proposal begins at `now`: one engine iteration since the last one."""
        if self._last_t is not None:
            self.period = ema(self.period, now - self._last_t)
        self._last_t = now

    def network_ran(self, seconds: float) -> None:
        """The network's candidates for a tree took `seconds` (its feed as charged)."""
        self.cost = ema(self.cost, seconds)

    def fed(self, seconds: float, steady: bool) -> float:
        """Feeding the network took `seconds`; `steady`: it fed at most one iteration's
        pairs → the seconds to charge the proposal. The network is fed lazily, so after
        iterations that skipped it one forward runs every pair since — whole prompts, at
        first. Charged to the proposal that follows, that one-off would price the
        network at what it costs when it is *not* used, and keep it unused; so only
        steady feeds are timed (until one is, a feed is charged as it came)."""
        if steady:
            self.feed_s = ema(self.feed_s, seconds)
        return self.feed_s if self.feed_s > 0 else seconds

    def small_timed(self, kind: str, proposing: float, rest: float) -> None:
        """A small budget's iteration: `kind`'s proposal took `proposing` seconds, the rest
        of the iteration `rest`."""
        self.small_s[kind] = ema(self.small_s[kind], proposing)
        self.small_s["rest"] = ema(self.small_s["rest"], rest)

    def tokens_brought(self, tokens: float, gain: float | None) -> None:
        """Tokens per row a tree iteration emitted, and (None: the network did not run)
        how many of them the network's candidates alone brought."""
        self.tokens = ema(self.tokens, tokens)
        if gain is not None:
            self.gain = ema(self.gain, gain)

    def small_tokens(self, kind: str, per_m: list[list[int]]) -> None:
        """Tokens each row gave (or would have given) at every budget m (per_m[m - 1])."""
        for m, xs in enumerate(per_m, start=1):
            if xs:
                old = self.small[kind][m - 1]
                self.small[kind][m - 1] = ema(old, sum(xs) / len(xs))

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
        self.gain, self.tokens, self.cost, self.period, skipped = state["network"]
        self._skipped = int(skipped)
        if "small" in state:  # checkpoints before the measured chain/tree choice lack it
            n = CHAIN_UP_TO
            self.small = {kind: (list(v) + [0.0] * n)[:n] for kind, v in state["small"].items()}
            self._small_iters = int(state["small_iters"])
        if "small_s" in state:  # ... and before it was timed
            self.small_s = dict(state["small_s"])
            self.feed_s = float(state.get("feed_s", 0.0))  # timed since small_s
