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
shared with the history drafter).

The budget can be filled in three forms (`forms`): the merged tree; history's tree
alone, the network's forwards skipped (on a CPU, where a draft forward is dear, history
alone often wins); and at a small budget (`engine.forms.CHAIN_UP_TO`) the network's
*sampled* chain
(the q-ratio test keeps more of a draft than deterministic candidates keep of the same
count, when the network predicts well; when history does, its top candidates keep far
more). Which one is not this drafter's decision: the engine's depth policy makes it with
the budget, on the tokens per second each form measured (`engine.forms`), and this
drafter reports what it measured inside a proposal (`report`: the network's feed and
forwards, and the tokens its candidates alone brought). So the drafter picks its sources
per row from running statistics — a row whose history matches well gets history's
continuations, a row without matches the draft's, rows in between a mix — and the one
controller picks the rest.

Where the host paces the device (a CPU) the merged tree is chosen on the host, after
one read of the network's candidates; elsewhere on the device (`drafters.merged_tree`,
the same tree), so that the iteration reads the device back once, and what was chosen
comes back with the step's read (`Proposal.echo`) for the calibration.

The tree is verified by `spec.tree`: any deterministic candidates are lossless, so the
mix never changes what a row samples.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch

from specroll.device import host_paced, upload
from specroll.drafters.base import DraftBatch, Drafter, Emitted, FormReport, Proposal, RowState
from specroll.drafters.candidate_tree import (
    Node,
    add_path,
    add_trie,
    best_first,
    proposal,
    tree_of,
)
from specroll.drafters.feature import FeatureDrafter
from specroll.drafters.history import MAX_DEPTH, HistoryDrafter
from specroll.drafters.merged_tree import merged_tree

SOURCES = ("history", "draft")
"""Calibration keys: the history drafter, the draft network."""
DRAFT_DEPTH = 6
"""Length of the draft network's greedy path (fewer when the budget is smaller)."""
DRAFT_WIDTH = 3
"""Candidates per position of that path: the path's token and the next likeliest."""
PRIOR = 4.0
"""Pseudo-count of the calibration prior (each source taken at its word)."""
DECAY = 0.99
"""Decay per iteration of the calibration counts."""


class _OnDevice(NamedTuple):
    """A tree chosen on the device (`CombinedDrafter._on_device`): what decoding its echo
    needs (`_chosen`)."""

    nodes: list[list[Node]]
    """Each row's history nodes, in the order sent."""
    ests: list[tuple[dict, int] | None]
    """Each row's estimates and cap (`_history_part`)."""
    H: int
    """History nodes per row as sent (padded): the network's candidates follow them."""
    d: int
    """The network's path length."""
    w: int
    """Its candidates per position."""
    echo: torch.Tensor
    """[B, k + 2·d·w] what the step's read brings back (`Proposal.echo`)."""


class CombinedDrafter(Drafter):
    """Merged history + draft-network trees (module docstring)."""

    tree = True
    watch_collapse = False
    forms = ("merged", "history", "chain")

    def __init__(self, history: HistoryDrafter, draft: FeatureDrafter) -> None:
        self.history, self.draft = history, draft
        self.name = f"history+{draft.name}"
        self.hidden_layers = draft.hidden_layers
        self.network = draft.network
        self.taken = dict.fromkeys(SOURCES, 0.0)
        """Decayed count of verified candidates of each source that were taken."""
        self.predicted = dict.fromkeys(SOURCES, 0.0)
        """Decayed sum of the conditional estimates of those candidates."""
        self._proposed: list[dict[Node, dict[str, float]] | None] = []
        self._report: FormReport | None = None  # what this iteration's proposal measured
        self._fresh = False  # proposed this iteration (commit learns only then)
        self._echoed: _OnDevice | None = None

    @property
    def version(self) -> int:
        return self.draft.version

    @version.setter
    def version(self, v: int) -> None:
        self.draft.version = v

    def _feed_network(self, batch: DraftBatch) -> None:
        """Feed the network the rows' pending pairs (`FeatureDrafter.catch_up`), timed
        into this proposal's report."""
        t = time.perf_counter()
        most = self.draft.catch_up(batch.last.shape[0], batch.history)
        self._report.feed = time.perf_counter() - t
        self._report.steady = 0 < most <= DRAFT_DEPTH + 1  # the pairs one iteration adds

    def calibration(self, source: str) -> float:
        """Taken / predicted for `source`'s candidates (1 before any evidence)."""
        return (self.taken[source] + PRIOR) / (self.predicted[source] + PRIOR)

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
        }

    def load_state_dict(self, state: dict) -> None:
        self.history.load_state_dict(state["history"])
        self.taken = {s: float(state["taken"][s]) for s in SOURCES}
        self.predicted = {s: float(state["predicted"][s]) for s in SOURCES}

    def report(self) -> FormReport | None:
        return self._report

    # the engine's hooks: both sources follow every row ---------------------------------
    def start(self, num_slots: int, max_len: int, rows: RowState | None = None) -> None:
        super().start(num_slots, max_len, rows)
        self.history.start(num_slots, max_len, self.rows)
        self.draft.start(num_slots, max_len, self.rows)
        self._proposed = [None] * num_slots

    def prefill(self, start: int, seqs: list[list[int]], hidden) -> None:
        self.history.prefill(start, seqs, hidden)
        self.draft.prefill(start, seqs, hidden)

    def commit(self, B, pos_before, num_new, hidden, read) -> None:
        if self._fresh:  # a plain iteration (no proposal) says nothing of the last one's
            if self._echoed is not None:  # a tree chosen on the device: what it was
                echo = read.echo
                if echo is None:  # (run outside the engine: `engine.walk`)
                    echo = self._echoed.echo.tolist()
                self._chosen(B, echo)
            self._learn(B, read)
        else:
            self._report = None
        self._fresh = False
        self.history.commit(B, pos_before, num_new, hidden, read)
        self.draft.commit(B, pos_before, num_new, hidden, read)

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
        """`batch.form` (None: merged): the network's sampled chain, or a tree of both
        sources' candidates or of history's alone."""
        if batch.form not in (None, *self.forms):
            raise ValueError(f"form must be one of {self.forms}, got {batch.form!r}")
        self._report, self._fresh = FormReport(), True
        self._echoed = None  # (a tree chosen on the device: what `_chosen` decodes)
        if batch.form == "chain":
            return self._chain(batch)
        return self._tree(batch, network=batch.form != "history")

    def _chain(self, batch: DraftBatch) -> Proposal:
        """The network's sampled chain of batch.k tokens."""
        B = batch.last.shape[0]
        self._proposed[:B] = [None] * B
        self._feed_network(batch)
        return self.draft.propose(batch)

    def _tree(self, batch: DraftBatch, network: bool) -> Proposal:
        """The merged tree of batch.k nodes per row (module docstring); `network`: with
        the draft network's candidates. Where the host paces the device (a CPU) the tree
        is chosen on the host; elsewhere on the device (`drafters.merged_tree`), so that
        the iteration reads the device back once."""
        B, k = batch.last.shape[0], batch.k
        self.history.sync(B)
        caps = batch.caps if batch.caps is not None else batch.num_draft.tolist()
        depth = min(DRAFT_DEPTH, k, max(caps, default=0))
        self._report.room = depth > 0
        net = depth > 0 and network
        self._proposed[:B] = [None] * B
        if not net:
            return self._on_host(batch, self._history_part(caps, MAX_DEPTH), None)
        now = time.perf_counter()
        self._feed_network(batch)
        toks, probs = self.draft.candidates(batch, depth, min(DRAFT_WIDTH, k))  # [B, d, w]
        # history's part on the host meanwhile (on a GPU it overlaps the network's forwards)
        ests = self._history_part(caps, max(MAX_DEPTH, depth))
        if not host_paced(batch.last.device):
            self._report.network = time.perf_counter() - now
            return self._on_device(batch, ests, toks, probs.double())
        # one read of both (float64 holds every id and fp32 probability exactly): the
        # tree is chosen on the host, so its form reads twice per iteration
        both = torch.stack([toks.double(), probs.double()]).tolist()  # [2, B, d, w]
        drafted = ([[[int(t) for t in d] for d in row] for row in both[0]], both[1])
        self._report.network = time.perf_counter() - now
        return self._on_host(batch, ests, drafted)

    def _history_part(self, caps: list[int], deepest: int) -> list[tuple[dict, int] | None]:
        """Per row: history's estimates (`add_trie`) down to its cap (the row's own, at
        most `deepest`), with that cap; None for a row that may not draft."""
        parts: list[tuple[dict, int] | None] = []
        for b, cap in enumerate(caps):
            cap = min(cap, deepest)
            if cap <= 0:
                parts.append(None)
                continue
            est: dict[Node, dict[str, float]] = {}
            root, total = self.history.continuations(b)
            if total > 0:
                add_trie(est, root, total, (), cap)
            parts.append((est, cap))
        return parts

    def _on_host(self, batch: DraftBatch, ests: list, drafted: tuple | None) -> Proposal:
        """The tree chosen on the host, from history's estimates and the network's
        candidates as read back (`drafted`: tokens and q per row, None: none)."""
        B, k = len(ests), batch.k
        c = {s: self.calibration(s) for s in SOURCES}
        tokens = [[0] * k for _ in range(B)]
        parents = [list(range(k)) for _ in range(B)]
        lengths = [0] * B
        for b, part in enumerate(ests):
            if part is None:
                continue
            est, cap = part
            if drafted is not None:
                add_path(est, drafted[0][b], drafted[1][b], cap)
            chosen = best_first(est, c, k)
            n = len(chosen)
            tokens[b][:n], parents[b][:n] = tree_of(chosen)
            lengths[b] = n
            self._proposed[b] = {node: est[node] for node in chosen}
        return proposal(tokens, parents, lengths, batch.last.device)

    def _on_device(
        self, batch: DraftBatch, ests: list, toks: torch.Tensor, q: torch.Tensor
    ) -> Proposal:
        """The tree chosen on the device (`merged_tree`) from history's nodes, sent in,
        and the network's candidates toks, q [B, d, w], never read back before the step:
        what the choice was comes back with the step's read (`Proposal.echo`), for
        `_learn`."""
        dev, k = batch.last.device, batch.k
        nodes = [[] if part is None else list(part[0]) for part in ests]
        H = max(1, *map(len, nodes))
        D = max([1, *(len(n) for row in nodes for n in row)])
        paths = [[[*n, *[-1] * (D - len(n))] for n in row] for row in nodes]
        paths = [row + [[-1] * D] * (H - len(row)) for row in paths]
        index = [{n: i for i, n in enumerate(row)} for row in nodes]
        parent = [[index[b].get(n[:-1], -1) for n in row] for b, row in enumerate(nodes)]
        est = [[part[0][n]["history"] for n in part[0]] if part else [] for part in ests]
        c = (self.calibration("history"), self.calibration("draft"))
        tokens, parents, lengths, chosen = merged_tree(
            upload(paths, dev),
            upload([p + [-1] * (H - len(p)) for p in parent], dev),
            upload([e + [0.0] * (H - len(e)) for e in est], dev, torch.float64),
            toks,
            q,
            upload([0 if part is None else part[1] for part in ests], dev),
            *c,
            k,
        )
        echo = torch.cat([chosen, toks.flatten(1), q.flatten(1).view(torch.long)], 1)
        self._echoed = _OnDevice(nodes, ests, H, *toks.shape[1:], echo)
        return Proposal(tokens, None, lengths, parents, echo=echo)

    def _chosen(self, B: int, echo: list[list[int]]) -> None:
        """`_proposed` of a tree chosen on the device, from what the step's read brought
        back of it (`_on_device`): the nodes and both sources' estimates, as `_on_host`
        keeps them."""
        nodes, ests, H, d, w, _ = self._echoed
        for b, part in enumerate(ests[:B]):
            if part is None:
                continue
            est, cap = part
            row = echo[b]
            chosen, toks = row[: -2 * d * w], row[-2 * d * w : -d * w]
            q = np.array(row[-d * w :], dtype=np.int64).view(np.float64).tolist()
            toks = [toks[i * w : (i + 1) * w] for i in range(d)]
            add_path(est, toks, [q[i * w : (i + 1) * w] for i in range(d)], cap)
            greedy = [t[0] for t in toks]
            names = [*nodes[b], *[None] * (H - len(nodes[b]))]
            names += [(*greedy[:i], toks[i][j]) for i in range(d) for j in range(w)]
            self._proposed[b] = {names[u]: est[names[u]] for u in chosen if u >= 0}

    def _learn(self, B: int, read: Emitted) -> None:
        """Calibrate each source on the candidates the walk reached this iteration: the
        children of every node on the accepted path, taken or not."""
        for s in SOURCES:
            self.taken[s] *= DECAY
            self.predicted[s] *= DECAY
        rows = [b for b in range(B) if self._proposed[b]]
        if not rows:
            return
        drafted = any("draft" in e for b in rows for e in self._proposed[b].values())
        gained = tokens = 0
        for b in rows:
            kept = read.entered(b)  # accepted candidates, then the token drawn
            tokens += len(kept)
            gained += self._calibrate(self._proposed[b], kept)
        self._report.tokens = tokens / len(rows)
        self._report.gain = gained / len(rows) if drafted else None

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
