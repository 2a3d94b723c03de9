"""History + a draft network: one tree per row from both, each source weighed by how
well it has predicted so far.

The history drafter (`drafters.history`) knows what the policy wrote before — siblings,
past epochs — and nothing else; an EAGLE-3 or MTP draft (`FeatureDrafter`) predicts any
text, less sharply. Per row and iteration this drafter merges both into one candidate
tree:

* history: the trie of what followed the row's matches, a child's conditional estimate
  being its frequency after its parent;
* the draft: its greedy path of `draft_depth` tokens and, at each position, its
  `draft_width` - 1 next likeliest tokens as leaves, each estimated by the draft's q
  (`FeatureDrafter.candidates`: deterministic, never the rows' draws).

A node's score is the estimated probability that the target's walk reaches it: the
product along its path of each step's conditional estimate, the estimate of a source
scaled by that source's *calibration* — the decayed ratio of how often its candidates
were taken to what it predicted for them (verified nodes whose parent the walk reached,
learnt in `commit` from the tokens that were kept). A node both sources propose takes
the larger estimate. The heaviest nodes (the engine's node budget, within the row's
depth cap) are proposed best first, parents before children. A budget of at most
`chain_up_to` nodes may draft the network's *sampled* chain instead: the q-ratio test
keeps more of a draft than deterministic candidates keep of the same count, when the
network predicts well; when history does (recurring prompts) its top candidates keep
far more. Which one, is measured: each one's tokens per row at each small budget (a
tree's for every budget up to the one it was verified at, from the index of the nodes
on the accepted path) over the seconds of an iteration drafting it (the kind's own
proposal time plus the rest of a small-budget iteration, which both share: the chain
runs the network once per token, a history tree builds a trie on the host), the faster
one drafted and the other probed every `probe_every` such iterations.
So the drafter picks itself, from running statistics: per row, a row whose
history matches well gets history's continuations, a row without matches the draft's,
rows in between a mix; per iteration, whether the network runs at all — only while the
share of the tokens its candidates alone brought is at least the share of the
iteration its forwards take (`draft_pays`; on a CPU, where a draft forward is dear,
history alone often wins); and the engine's adaptive tree size (`engine.depth`,
`tree=True`) picks the budget from those trees' measured acceptance and the cost of
verifying them.

The tree is verified by `spec.tree`: any deterministic candidates are lossless, so the
mix never changes what a row samples.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import torch

from specroll.drafters.base import DraftBatch, Drafter, FeatureDrafter, Proposal
from specroll.drafters.history import HistoryDrafter, trie

SOURCES = ("history", "draft")
"""Calibration keys: the history drafter, the draft network."""


@dataclass
class CombinedConfig:
    """How the draft network's candidates join the history's."""

    draft_depth: int = 6
    """Length of the draft network's greedy path (fewer when the budget is smaller)."""
    draft_width: int = 3
    """Candidates per position of that path: the path's token and the next likeliest."""
    decay: float = 0.99
    """Decay per iteration of the calibration counts (the policy and the draft change)."""
    prior: float = 4.0
    """Pseudo-count of the calibration prior (each source taken at its word)."""
    probe_every: int = 16
    """While the draft network is skipped (it cost more of an iteration than it brought
    of its tokens), run it anyway every this many iterations to measure it again."""
    chain_up_to: int = 2
    """Budgets of at most this many nodes may draft the network's *sampled* chain
    instead, while it measures more tokens per row per second there than the tree (the
    q-ratio test keeps more of a draft than deterministic candidates do: tau(1) 1.34
    against 1.26, SmolLM2 math at T = 1, batch 32, one epoch; but each of its tokens
    costs a network forward, and where history predicts well its top candidates keep
    more); 0 = always a tree."""

    def __post_init__(self) -> None:
        for name in ("draft_depth", "draft_width"):
            if getattr(self, name) < 1:
                raise ValueError(f"combined.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"combined.decay must be in (0, 1], got {self.decay}")
        if self.prior <= 0:
            raise ValueError(f"combined.prior must be > 0, got {self.prior}")
        if self.probe_every < 1:
            raise ValueError(f"combined.probe_every must be >= 1, got {self.probe_every}")
        if self.chain_up_to < 0:
            raise ValueError(f"combined.chain_up_to must be >= 0, got {self.chain_up_to}")


Node = tuple[int, ...]
"""A candidate: its path of tokens after the row's last one."""


class CombinedDrafter(Drafter):
    """Merged history + draft-network trees (module docstring)."""

    tree = True
    watch_collapse = False

    def __init__(
        self, history: HistoryDrafter, draft: FeatureDrafter, config: CombinedConfig | None = None
    ) -> None:
        self.history, self.draft = history, draft
        self.config = config or CombinedConfig()
        self.name = f"history+{draft.name}"
        self.hidden_layers = draft.hidden_layers
        self.network = draft.network
        self.taken = dict.fromkeys(SOURCES, 0.0)
        """Decayed count of verified candidates of each source that were taken."""
        self.predicted = dict.fromkeys(SOURCES, 0.0)
        """Decayed sum of the conditional estimates of those candidates."""
        self._proposed: list[dict[Node, dict[str, float]] | None] = []
        # is the network worth its forwards? decayed per-iteration figures: tokens per
        # row its candidates alone brought, tokens per row, its seconds, the iteration's
        self.gain = self.tokens = self.cost = self.period = 0.0
        self._last_t: float | None = None
        self._skipped = 0
        # small budgets: decayed tokens per row the chain / the tree gave at budget m
        # (index m - 1), the last small iteration's kind and budget, and a probe clock
        self.small = {kind: [0.0] * self.config.chain_up_to for kind in ("chain", "tree")}
        # ... and their seconds: each kind's proposal, the rest of such an iteration
        self.small_s = {"chain": 0.0, "tree": 0.0, "rest": 0.0}
        self._t_proposed: tuple[str, float, float] | None = None  # kind, its s, end time
        self.feed_s = 0.0  # decayed seconds of feeding the network one iteration's pairs
        self._chain_k = self._tree_k = 0
        self._small_iters = 0
        self._fresh = False  # proposed this iteration (commit learns only then)

    @property
    def version(self) -> int:
        return self.draft.version

    @version.setter
    def version(self, v: int) -> None:
        self.draft.version = v

    def draft_pays(self) -> bool:
        """Run the network this iteration? Yes while the share of the tokens its
        candidates alone brought is at least the share of the iteration its forwards
        took (tokens per second then rise with it), and every `probe_every` iterations
        when not (to measure it again)."""
        if self.period <= 0 or self.tokens <= 0:
            return True
        if self.gain / self.tokens >= self.cost / self.period:
            self._skipped = 0
            return True
        self._skipped += 1
        return self._skipped % self.config.probe_every == 0

    def use_chain(self, k: int) -> bool:
        """Draft the sampled chain at a budget of k <= `chain_up_to`? Yes while it has
        given more tokens per row per second there than the tree (tokens alone until both
        are timed; each tried first while unmeasured; the loser probed every
        `probe_every` iterations)."""
        chain, tree = self.small["chain"][k - 1], self.small["tree"][k - 1]
        if chain == 0 or tree == 0:
            return chain == 0
        t = self.small_s
        if t["chain"] > 0 and t["tree"] > 0:  # per second: the iteration both kinds share
            chain, tree = chain / (t["rest"] + t["chain"]), tree / (t["rest"] + t["tree"])
        self._small_iters += 1
        probe = self._small_iters % self.config.probe_every == 0
        return (chain > tree) != probe

    def _feed_network(self, batch: DraftBatch) -> tuple[float, float]:
        """Feed the network the rows' pending pairs (`FeatureDrafter.catch_up`) → (the
        seconds to charge the proposal: what feeding costs per iteration when it runs
        every iteration; the seconds it took). The network is fed lazily, so after
        iterations that skipped it one forward runs every pair since — whole prompts, at
        first. Charged to the proposal that follows, that one-off would price
        the network at what it costs when it is *not* used, and keep it unused; so only
        feeds of at most one iteration's pairs are timed (until one is, the feed is
        charged as it came)."""
        t = time.perf_counter()
        most = self.draft.catch_up(batch.last.shape[0], batch.history)
        seconds = time.perf_counter() - t
        if 0 < most <= self.config.draft_depth + 1:  # the pairs one iteration adds
            self.feed_s = _avg(self.feed_s, seconds, self.config.decay)
        return (self.feed_s if self.feed_s > 0 else seconds), seconds

    def calibration(self, source: str) -> float:
        """Taken / predicted for `source`'s candidates (1 before any evidence)."""
        a = self.config.prior
        return (self.taken[source] + a) / (self.predicted[source] + a)

    def remember(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Add a finished rollout to the history (`HistoryDrafter.remember`)."""
        self.history.remember(prompt_ids, output_ids)

    def state_dict(self) -> dict:
        """The history store and the calibration counts (what a checkpoint saves; the
        network's weights are saved with the draft)."""
        return {
            "history": self.history.state_dict(),
            "taken": dict(self.taken),
            "predicted": dict(self.predicted),
            "network": [self.gain, self.tokens, self.cost, self.period, self._skipped],
            "small": {kind: list(v) for kind, v in self.small.items()},
            "small_s": dict(self.small_s),
            "feed_s": self.feed_s,
            "small_iters": self._small_iters,
        }

    def load_state_dict(self, state: dict) -> None:
        self.history.load_state_dict(state["history"])
        self.taken, self.predicted = dict(state["taken"]), dict(state["predicted"])
        self.gain, self.tokens, self.cost, self.period, skipped = state["network"]
        self._skipped = int(skipped)
        if "small" in state:  # checkpoints before the measured chain/tree choice lack it
            n = self.config.chain_up_to
            self.small = {kind: (list(v) + [0.0] * n)[:n] for kind, v in state["small"].items()}
            self._small_iters = int(state["small_iters"])
        if "small_s" in state:  # ... and before it was timed
            self.small_s = dict(state["small_s"])
            self.feed_s = float(state.get("feed_s", 0.0))  # timed since small_s

    # the engine's hooks: both sources follow every row ---------------------------------
    def start(self, num_slots: int, max_len: int) -> None:
        self.history.start(num_slots, max_len)
        self.draft.start(num_slots, max_len)
        self._proposed = [None] * num_slots
        self._last_t = None  # the time between calls is not an iteration

    def prefill(self, start: int, seqs: list[list[int]], hidden) -> None:
        self.history.prefill(start, seqs, hidden)
        self.draft.prefill(start, seqs, hidden)

    def commit(self, B, pos_before, num_new, hidden, history) -> None:
        if self._fresh:  # a plain iteration (no proposal) says nothing of the last one's
            self._learn(B, pos_before, num_new, history)
        self._fresh = False
        self.history.commit(B, pos_before, num_new, hidden, history)
        self.draft.commit(B, pos_before, num_new, hidden, history)
        if self._t_proposed is not None:  # a small budget's iteration: time its parts
            kind, proposing, end = self._t_proposed
            d, t = self.config.decay, self.small_s
            t[kind] = _avg(t[kind], proposing, d)
            t["rest"] = _avg(t["rest"], time.perf_counter() - end, d)
            self._t_proposed = None

    def release(self, slot: int, generated: int) -> None:
        self.history.release(slot, generated)
        self.draft.release(slot, generated)
        self._proposed[slot] = None

    def move(self, src: int, dst: int) -> None:
        self.history.move(src, dst)
        self.draft.move(src, dst)
        self._proposed[dst], self._proposed[src] = self._proposed[src], None

    def warm(self) -> None:
        self.draft.warm()

    # proposing -------------------------------------------------------------------------
    def propose(self, batch: DraftBatch) -> Proposal:
        k = batch.k
        chain = 0 < k <= self.config.chain_up_to and self.use_chain(k)  # measured faster
        t0 = time.perf_counter()
        out, uncharged = self._chain(batch) if chain else self._tree(batch)
        if 0 < k <= self.config.chain_up_to:
            end = time.perf_counter()
            self._t_proposed = ("chain" if chain else "tree", end - t0 - uncharged, end)
        return out

    def _chain(self, batch: DraftBatch) -> tuple[Proposal, float]:
        """The network's sampled chain of batch.k tokens, and the feed's seconds not to
        charge it (`_feed_network`)."""
        B = batch.last.shape[0]
        self._chain_k, self._tree_k, self._fresh = batch.k, 0, True
        self._proposed[:B] = [None] * B
        charged, took = self._feed_network(batch)
        return self.draft.propose(batch), took - charged

    def _tree(self, batch: DraftBatch) -> tuple[Proposal, float]:
        """The merged tree of batch.k nodes per row (module docstring), and the network
        feed's seconds not to charge it (`_feed_network`)."""
        B, k = batch.last.shape[0], batch.k
        cfg, hcfg = self.config, self.history.config
        self.history.sync(B, batch.pos, batch.history)
        self._chain_k, self._tree_k, self._fresh = 0, k, True
        caps = batch.num_draft.tolist()
        depth = min(cfg.draft_depth, k, max(caps, default=0))
        drafted, now = None, time.perf_counter()
        if self._last_t is not None:  # one engine iteration since the last proposal
            self.period = _avg(self.period, now - self._last_t, cfg.decay)
        self._last_t = now
        uncharged = 0.0
        if depth > 0 and self.draft_pays():
            width = min(cfg.draft_width, k)
            charged, took = self._feed_network(batch)
            uncharged = took - charged
            toks, probs = self.draft.candidates(batch, depth, width)  # [B, depth, width]
            drafted = (toks.tolist(), probs.tolist())
            spent = time.perf_counter() - now - uncharged
            self.cost = _avg(self.cost, spent, cfg.decay)
        c = {s: self.calibration(s) for s in SOURCES}
        tokens = [[0] * k for _ in range(B)]
        parents = [list(range(k)) for _ in range(B)]
        lengths = [0] * B
        for b in range(B):
            self._proposed[b] = None
            cap = min(caps[b], hcfg.max_depth if drafted is None else max(hcfg.max_depth, depth))
            if cap <= 0:
                continue
            est: dict[Node, dict[str, float]] = {}
            root, total = trie(self.history._occurrences(self.history.slots[b]), hcfg.max_depth)
            if total > 0:
                _add_trie(est, root, total, (), cap)
            if drafted is not None:
                _add_path(est, drafted[0][b], drafted[1][b], cap)
            chosen = _best(est, c, k)
            index = {node: i + 1 for i, node in enumerate(chosen)}
            tokens[b][: len(chosen)] = [node[-1] for node in chosen]
            parents[b][: len(chosen)] = [index.get(node[:-1], 0) for node in chosen]
            lengths[b] = len(chosen)
            self._proposed[b] = {node: est[node] for node in chosen}
        width = max(lengths, default=0)  # as wide as the fullest row (see history)
        long = dict(dtype=torch.long, device=batch.last.device)
        proposal = Proposal(
            tokens=torch.tensor([t[:width] for t in tokens], **long).view(B, width),
            probs=None,
            lengths=torch.tensor(lengths, **long),
            parents=torch.tensor([p[:width] for p in parents], **long).view(B, width),
        )
        return proposal, uncharged

    def _learn(self, B: int, pos_before, num_new, history: torch.Tensor) -> None:
        """Calibrate each source on the candidates the walk reached this iteration: the
        children of every node on the accepted path, taken or not."""
        d = self.config.decay
        for s in SOURCES:
            self.taken[s] *= d
            self.predicted[s] *= d
        width = int(num_new[:B].max())
        col = torch.arange(1, width + 1, device=history.device)
        at = (pos_before[:B].unsqueeze(1) + col).clamp(max=history.shape[1] - 1)  # [B, W]
        new, counts = history[:B].gather(1, at).tolist(), num_new.tolist()
        if self.config.chain_up_to:
            self._learn_small([new[b][: counts[b]] for b in range(B)])
        rows = [b for b in range(B) if self._proposed[b]]
        if not rows:
            return
        drafted = any("draft" in e for b in rows for e in self._proposed[b].values())
        gained = tokens = 0
        for b in rows:
            est = self._proposed[b]
            kept = new[b][: counts[b]]  # accepted candidates, then the token drawn
            children: dict[Node, list[Node]] = {}
            for node in est:
                children.setdefault(node[:-1], []).append(node)
            tokens += len(kept)
            path: Node = ()
            for depth, y in enumerate(kept):
                reached = children.get(path, [])
                last = depth == len(kept) - 1
                if last and any(n[-1] == y for n in reached):
                    break  # cut by a stop or the budget, not by a miss: no evidence
                for node in reached:
                    for s, cond in est[node].items():
                        self.predicted[s] += cond
                        self.taken[s] += float(node[-1] == y)
                path = (*path, y)
                if path not in est:
                    break
                if "history" not in est[path]:  # the walk went on through the network's
                    gained += len(kept) - 1 - depth  # candidate: what followed is its
                    break
        self.tokens = _avg(self.tokens, tokens / len(rows), d)
        if drafted:  # what the network's candidates brought, measured when it ran
            self.gain = _avg(self.gain, gained / len(rows), d)

    def _learn_small(self, kept: list[list[int]]) -> None:
        """Tokens per row each budget m <= `chain_up_to` gave (a chain: 1 + its first m
        drafts accepted) or would have given (a tree verified at a budget of at least m,
        proposed best first and parents first: 1 + the accepted path's leading nodes
        numbered m or less). kept[b]: row b's accepted drafts, then the token drawn."""
        if self._chain_k:
            kind, upto = "chain", self._chain_k
            per_m = [[1 + min(len(x) - 1, m) for x in kept] for m in range(1, upto + 1)]
        else:
            rows = [b for b in range(len(kept)) if self._proposed[b] is not None]
            kind, upto = "tree", min(self.config.chain_up_to, self._tree_k)
            per_m = [[] for _ in range(upto)]
            for b in rows:
                index = {node: i + 1 for i, node in enumerate(self._proposed[b])}
                x = kept[b]
                path = [index.get(tuple(x[: j + 1]), 1 << 30) for j in range(len(x) - 1)]
                for m in range(1, upto + 1):
                    per_m[m - 1].append(
                        1 + next((j for j, i in enumerate(path) if i > m), len(path))
                    )
        for m, xs in enumerate(per_m, start=1):
            if xs:
                old = self.small[kind][m - 1]
                self.small[kind][m - 1] = _avg(old, sum(xs) / len(xs), self.config.decay)


def _avg(old: float, new: float, decay: float) -> float:
    """Exponential moving average (the first value taken as it is)."""
    return new if old == 0 else decay * old + (1 - decay) * new


def _add_trie(est: dict, level: dict, parent_w: float, prefix: Node, cap: int) -> None:
    """The history trie's nodes down to depth `cap`, each with its frequency after its
    parent."""
    if len(prefix) >= cap:
        return
    for tok, (w, children) in level.items():
        node = (*prefix, tok)
        est.setdefault(node, {})["history"] = w / parent_w
        _add_trie(est, children, w, node, cap)


def _add_path(est: dict, toks: list[list[int]], probs: list[list[float]], cap: int) -> None:
    """The draft's greedy path (column 0) and, at each position, its other candidates."""
    prefix: Node = ()
    for i in range(min(len(toks), cap)):
        for tok, q in zip(toks[i], probs[i], strict=True):
            if q > 0:
                node = (*prefix, tok)
                est.setdefault(node, {})["draft"] = q
        prefix = (*prefix, toks[i][0])


def _best(est: dict[Node, dict[str, float]], c: dict[str, float], k: int) -> list[Node]:
    """The k nodes with the highest calibrated path scores, best first, parents first."""
    score: dict[Node, float] = {(): 1.0}
    for node in sorted(est, key=len):  # parents scored before their children
        cond = max(min(1.0, c[s] * v) for s, v in est[node].items())
        score[node] = score[node[:-1]] * cond
    del score[()]
    return heapq.nsmallest(k, score, key=lambda n: (-score[n], len(n), n))
