"""History + a draft network: one tree per row from both, each source weighed by how
well it has predicted so far.

The history drafter (`drafters.history`) knows what the policy wrote before — siblings,
past epochs — and nothing else; an EAGLE-3 or MTP draft (`FeatureDrafter`) predicts any
text, less sharply. Per row and iteration this drafter merges both into one candidate
tree:

* history: the trie of what followed the row's matches, a child's conditional estimate
  being its frequency after its parent;
* the draft: its greedy path of `DRAFT_DEPTH` tokens and, at each position, its
  `DRAFT_WIDTH` - 1 next likeliest tokens as leaves, each estimated by the draft's q
  (`FeatureDrafter.candidates`: deterministic, never the rows' draws).

A node's score is the estimated probability that the target's walk reaches it: the
product along its path of each step's conditional estimate, the estimate of a source
scaled by that source's *calibration* — the decayed ratio of how often its candidates
were taken to what it predicted for them (verified nodes whose parent the walk reached,
learnt in `commit` from the tokens that were kept). A node both sources propose takes
the larger estimate. The heaviest nodes (the engine's node budget, within the row's
depth cap) are proposed best first, parents before children (`drafters.candidate_tree`,
shared with the history drafter). A budget of at most
`CHAIN_UP_TO` nodes may draft the network's *sampled* chain instead: the q-ratio test
keeps more of a draft than deterministic candidates keep of the same count, when the
network predicts well; when history does (recurring prompts) its top candidates keep
far more. Which one, is measured: each one's tokens per row at each small budget (a
tree's for every budget up to the one it was verified at, from the index of the nodes
on the accepted path) over the seconds of an iteration drafting it (the kind's own
proposal time plus the rest of a small-budget iteration, which both share: the chain
runs the network once per token, a history tree builds a trie on the host), the faster
one drafted and the other probed every `PROBE_EVERY` such iterations.
So the drafter picks itself, from running statistics: per row, a row whose
history matches well gets history's continuations, a row without matches the draft's,
rows in between a mix; per iteration, whether the network runs at all — only while the
share of the tokens its candidates alone brought is at least the share of the
iteration its forwards take (on a CPU, where a draft forward is dear, history alone
often wins). Those two choices — network or not, chain or tree — are made by one
controller, `drafters.proposal_choice.ProposalChoice` (`self.choice`), to which this
drafter reports what it measured; the engine's adaptive tree size (`engine.depth`,
`tree=True`) picks the budget from those trees' measured acceptance and the cost of
verifying them.

The tree is verified by `spec.tree`: any deterministic candidates are lossless, so the
mix never changes what a row samples.
"""

from __future__ import annotations

import time

import torch

from specroll.drafters.base import DraftBatch, Drafter, FeatureDrafter, Proposal
from specroll.drafters.candidate_tree import (
    Node,
    add_path,
    add_trie,
    best_first,
    proposal,
    tree_of,
)
from specroll.drafters.history import HistoryDrafter
from specroll.drafters.proposal_choice import CHAIN_UP_TO, DECAY, ProposalChoice

SOURCES = ("history", "draft")
"""Calibration keys: the history drafter, the draft network."""
DRAFT_DEPTH = 6
"""Length of the draft network's greedy path (fewer when the budget is smaller)."""
DRAFT_WIDTH = 3
"""Candidates per position of that path: the path's token and the next likeliest."""
PRIOR = 4.0
"""Pseudo-count of the calibration prior (each source taken at its word)."""


class CombinedDrafter(Drafter):
    """Merged history + draft-network trees (module docstring)."""

    tree = True
    watch_collapse = False

    def __init__(self, history: HistoryDrafter, draft: FeatureDrafter) -> None:
        self.history, self.draft = history, draft
        self.name = f"history+{draft.name}"
        self.hidden_layers = draft.hidden_layers
        self.network = draft.network
        self.taken = dict.fromkeys(SOURCES, 0.0)
        """Decayed count of verified candidates of each source that were taken."""
        self.predicted = dict.fromkeys(SOURCES, 0.0)
        """Decayed sum of the conditional estimates of those candidates."""
        self.choice = ProposalChoice()
        """Network or not, chain or tree: what fills the engine's budget."""
        self._proposed: list[dict[Node, dict[str, float]] | None] = []
        self._t_proposed: tuple[str, float, float] | None = None  # kind, its s, end time
        self._chain_k = self._tree_k = 0
        self._fresh = False  # proposed this iteration (commit learns only then)

    @property
    def version(self) -> int:
        return self.draft.version

    @version.setter
    def version(self, v: int) -> None:
        self.draft.version = v

    def _feed_network(self, batch: DraftBatch) -> tuple[float, float]:
        """Feed the network the rows' pending pairs (`FeatureDrafter.catch_up`) → (the
        seconds to charge the proposal, `ProposalChoice.fed`; the seconds it took)."""
        t = time.perf_counter()
        most = self.draft.catch_up(batch.last.shape[0], batch.history)
        seconds = time.perf_counter() - t
        steady = 0 < most <= DRAFT_DEPTH + 1  # the pairs one iteration adds
        return self.choice.fed(seconds, steady), seconds

    def calibration(self, source: str) -> float:
        """Taken / predicted for `source`'s candidates (1 before any evidence)."""
        return (self.taken[source] + PRIOR) / (self.predicted[source] + PRIOR)

    def remember(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Add a finished rollout to the history (`HistoryDrafter.remember`)."""
        self.history.remember(prompt_ids, output_ids)

    def state_dict(self) -> dict:
        """The history store, the calibration counts and the proposal choice's figures
        (what a checkpoint saves; the network's weights are saved with the draft)."""
        return {
            "history": self.history.state_dict(),
            "taken": dict(self.taken),
            "predicted": dict(self.predicted),
            **self.choice.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.history.load_state_dict(state["history"])
        self.taken, self.predicted = dict(state["taken"]), dict(state["predicted"])
        self.choice.load_state_dict(state)

    # the engine's hooks: both sources follow every row ---------------------------------
    def start(self, num_slots: int, max_len: int) -> None:
        self.history.start(num_slots, max_len)
        self.draft.start(num_slots, max_len)
        self._proposed = [None] * num_slots
        self.choice.restart()  # the time between calls is not an iteration

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
            self.choice.small_timed(kind, proposing, time.perf_counter() - end)
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
        small = self.choice.small_budget(k)
        chain = small and self.choice.use_chain(k)  # measured faster
        t0 = time.perf_counter()
        out, uncharged = self._chain(batch) if chain else self._tree(batch)
        if small:
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
        max_depth = self.history.config.max_depth
        self.history.sync(B, batch.pos, batch.history)
        self._chain_k, self._tree_k, self._fresh = 0, k, True
        caps = batch.num_draft.tolist()
        depth = min(DRAFT_DEPTH, k, max(caps, default=0))
        drafted, now = None, time.perf_counter()
        self.choice.tree_started(now)
        uncharged = 0.0
        if depth > 0 and self.choice.network_pays():
            charged, took = self._feed_network(batch)
            uncharged = took - charged
            toks, probs = self.draft.candidates(batch, depth, min(DRAFT_WIDTH, k))  # [B, d, w]
            drafted = (toks.tolist(), probs.tolist())
            self.choice.network_ran(time.perf_counter() - now - uncharged)
        c = {s: self.calibration(s) for s in SOURCES}
        tokens = [[0] * k for _ in range(B)]
        parents = [list(range(k)) for _ in range(B)]
        lengths = [0] * B
        for b in range(B):
            self._proposed[b] = None
            cap = min(caps[b], max_depth if drafted is None else max(max_depth, depth))
            if cap <= 0:
                continue
            est: dict[Node, dict[str, float]] = {}
            root, total = self.history.continuations(b)
            if total > 0:
                add_trie(est, root, total, (), cap)
            if drafted is not None:
                add_path(est, drafted[0][b], drafted[1][b], cap)
            chosen = best_first(est, c, k)
            n = len(chosen)
            tokens[b][:n], parents[b][:n] = tree_of(chosen)
            lengths[b] = n
            self._proposed[b] = {node: est[node] for node in chosen}
        return proposal(tokens, parents, lengths, batch.last.device), uncharged

    def _learn(self, B: int, pos_before, num_new, history: torch.Tensor) -> None:
        """Calibrate each source on the candidates the walk reached this iteration: the
        children of every node on the accepted path, taken or not."""
        for s in SOURCES:
            self.taken[s] *= DECAY
            self.predicted[s] *= DECAY
        width = int(num_new[:B].max())
        col = torch.arange(1, width + 1, device=history.device)
        at = (pos_before[:B].unsqueeze(1) + col).clamp(max=history.shape[1] - 1)  # [B, W]
        new, counts = history[:B].gather(1, at).tolist(), num_new.tolist()
        self._learn_small([new[b][: counts[b]] for b in range(B)])
        rows = [b for b in range(B) if self._proposed[b]]
        if not rows:
            return
        drafted = any("draft" in e for b in rows for e in self._proposed[b].values())
        gained = tokens = 0
        for b in rows:
            kept = new[b][: counts[b]]  # accepted candidates, then the token drawn
            tokens += len(kept)
            gained += self._calibrate(self._proposed[b], kept)
        self.choice.tokens_brought(tokens / len(rows), gained / len(rows) if drafted else None)

    def _calibrate(self, est: dict[Node, dict[str, float]], kept: list[int]) -> int:
        """Count one row's reached candidates into the calibration → the tokens only the
        network's candidates brought (what followed the walk's first step through one)."""
        children: dict[Node, list[Node]] = {}
        for node in est:
            children.setdefault(node[:-1], []).append(node)
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
                return len(kept) - 1 - depth  # candidate: what followed is its
        return 0

    def _learn_small(self, kept: list[list[int]]) -> None:
        """Tokens per row each budget m <= `CHAIN_UP_TO` gave (a chain: 1 + its first m
        drafts accepted) or would have given (a tree verified at a budget of at least m,
        proposed best first and parents first: 1 + the accepted path's leading nodes
        numbered m or less). kept[b]: row b's accepted drafts, then the token drawn."""
        if self._chain_k:
            kind, upto = "chain", self._chain_k
            per_m = [[1 + min(len(x) - 1, m) for x in kept] for m in range(1, upto + 1)]
        else:
            rows = [b for b in range(len(kept)) if self._proposed[b] is not None]
            kind, upto = "tree", min(CHAIN_UP_TO, self._tree_k)
            per_m = [[] for _ in range(upto)]
            for b in rows:
                index = {node: i + 1 for i, node in enumerate(self._proposed[b])}
                x = kept[b]
                path = [index.get(tuple(x[: j + 1]), 1 << 30) for j in range(len(x) - 1)]
                for m in range(1, upto + 1):
                    per_m[m - 1].append(
                        1 + next((j for j, i in enumerate(path) if i > m), len(path))
                    )
        self.choice.small_tokens(kind, per_m)
