"""The history drafter: candidate trees from what the policy has already written.

RL samples every prompt G times in one step and revisits its prompts every epoch, and as
training sharpens the policy its answers to a prompt converge. This drafter drafts from
that, with no network and no forward: a suffix index (`SuffixIndex`) over

* the row's own prompt and output so far,
* the live outputs of its siblings (rows with the same prompt, generating now),
* earlier rollouts of the same prompt (past steps and epochs, `PAST` per prompt),
* a window of recent rollouts of other prompts (`WINDOW`),

finds where the row's latest tokens occurred before (longest match first, shorter ones
filling up to `MATCHES` occurrences), and merges what followed them into a tree of
candidates scored by frequency (`candidate_tree.tree_from`): the most frequent
continuations, best first, up to the engine's node budget and `MAX_DEPTH`. The size of
each iteration's trees follows the matches: the proposal is only as wide as its fullest
row, so the target scores no padding nodes. The bounds are module constants (`PAST`,
`WINDOW`, `PROMPTS`, `MAX_DEPTH`): no setting reaches them.
The engine verifies the tree losslessly (`spec.tree`): history tokens are candidates,
never samples, so no rollout reuses another's randomness.

A prompt is identified by its token ids, so siblings and past epochs need no bookkeeping
from the caller. Everything here is host-side Python over small lists; its time per
iteration is the engine's `draft_s` (`bench spec` reports it).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from specroll.drafters.base import DraftBatch, Drafter, Proposal, RowState
from specroll.drafters.candidate_tree import Occurrence, Trie, proposal, tree_from, trie
from specroll.drafters.suffix_index import SuffixIndex

SOURCES = ("prompt", "siblings", "past", "others")
"""What the drafter may draft from (see the module docstring)."""
N_MAX = 8
"""Longest suffix of a row looked up."""
MATCHES = 16
"""Most earlier occurrences merged into one tree."""
MAX_DEPTH = 8
"""Deepest candidate (tokens past the row's last one)."""
PAST = 16
"""Finished rollouts kept per prompt (past steps and epochs)."""
WINDOW = 256
"""Finished rollouts of any prompt kept for drafting across prompts."""
PROMPTS = 128
"""Prompts whose history is kept; the least recently seen one goes first (its live
rows, if any, stay until they finish). Memory: about 1.3 kB per remembered token, so
128 prompts x 16 rollouts x 512 tokens is about 1.4 GB at most."""


class HistoryDrafter(Drafter):
    """Model-free drafter of candidate trees from rollout history (module docstring)."""

    name = "history"
    tree = True
    watch_collapse = False

    def __init__(self, sources: tuple[str, ...] = SOURCES, chain: bool = False) -> None:
        """sources: which of prompt / siblings / past / others to draft from; chain:
        propose one path (the likeliest continuation) instead of a tree."""
        self.sources, self.chain = tuple(sources), chain
        bad = [s for s in self.sources if s not in SOURCES]
        if bad or not self.sources:
            raise ValueError(
                f"history sources must be a non-empty subset of {', '.join(SOURCES)}; "
                f"got {', '.join(self.sources) or 'nothing'}"
            )
        self.prompts: OrderedDict[tuple[int, ...], _Prompt] = OrderedDict()
        self.others = SuffixIndex(N_MAX)
        self.recent: deque[int] = deque()  # finished rollouts in `others`, oldest first
        self._next_id = 0
        self.slots: list[_Row | None] = []
        self.learn = True
        """Finished rollouts join the history; False holds it fixed (`remember` still adds)."""

    # the engine's hooks ---------------------------------------------------------------
    def start(self, num_slots: int, max_len: int, rows: RowState | None = None) -> None:
        super().start(num_slots, max_len, rows)
        for row in self.slots:  # a call that stopped half-way: its rows are not history
            if row is not None:
                row.prompt.index.drop(row.sid)
                row.prompt.live.discard(row.sid)
        self.slots = [None] * num_slots

    def prefill(self, start: int, seqs: list[list[int]], hidden) -> None:
        for i, seq in enumerate(seqs):
            prompt = self._prompt(tuple(seq[:-1]))
            row = _Row(prompt, self._new_id(), list(seq))
            # from the n-gram ending the prompt: what followed it is the first output token
            prompt.index.extend(row.sid, row.tokens, len(seq) - 2)
            prompt.live.add(row.sid)
            self.slots[start + i] = row

    def commit(self, B, pos_before, num_new, hidden, read) -> None:
        # the rows' new tokens come from the engine's one read; they are indexed when the
        # row is next drafted from (`sync`) or finishes (`release`), so the large-batch
        # head of a rollout, where no row drafts, costs a list append per row here
        for b, row in enumerate(self.slots[:B]):
            if row is not None:
                row.new += read.kept(b)

    def sync(self, B: int) -> None:
        """Index the new tokens of rows 0..B-1 (every live row: a row drafts from its
        live siblings): their n-grams join the suffix index."""
        for row in self.slots[:B]:
            if row is not None:
                self._index(row)

    @staticmethod
    def _index(row: _Row) -> None:
        if row.new:
            known = len(row.tokens)
            row.tokens += row.new
            row.new = []
            row.prompt.index.extend(row.sid, row.tokens, known)

    def release(self, slot: int, generated: int) -> None:
        row, self.slots[slot] = self.slots[slot], None
        if row is not None:
            end = len(row.prompt.ids) + generated  # the rollout: prompt and output
            if self.learn:
                self._index(row)
            del row.tokens[end:]  # (n-grams indexed past the end point past it: skipped)
            self._keep(row, learn=self.learn)

    def _keep(self, row: _Row, learn: bool) -> None:
        """A finished rollout joins the history (`learn`), or leaves the index."""
        if not learn:
            row.prompt.live.discard(row.sid)
            row.prompt.index.drop(row.sid)
            return
        prompt = row.prompt
        prompt.live.discard(row.sid)
        if "past" in self.sources and PAST > 0:
            if row.sid not in prompt.index.seqs:
                prompt.index.extend(row.sid, row.tokens, len(prompt.ids) - 1)
            prompt.done.append(row.sid)
            while len(prompt.done) > PAST:
                prompt.index.drop(prompt.done.popleft())
        else:
            prompt.index.drop(row.sid)
        if "others" in self.sources and WINDOW > 0:
            self.others.extend(row.sid, row.tokens, len(prompt.ids) - 1)
            self.recent.append(row.sid)
            while len(self.recent) > WINDOW:
                self.others.drop(self.recent.popleft())

    def move(self, src: int, dst: int) -> None:
        self.slots[dst], self.slots[src] = self.slots[src], None

    def propose(self, batch: DraftBatch) -> Proposal:
        B, k = batch.last.shape[0], batch.k
        self.sync(B)
        caps = batch.caps if batch.caps is not None else batch.num_draft.tolist()
        tokens = [[0] * k for _ in range(B)]
        parents = [list(range(k)) for _ in range(B)]
        lengths = [0] * B
        for b in range(B):
            if caps[b] <= 0:
                continue
            occ = self._occurrences(self.slots[b])
            toks, pars = tree_from(occ, k, min(MAX_DEPTH, caps[b]), self.chain)
            n = len(toks)
            tokens[b][:n], parents[b][:n], lengths[b] = toks, pars, n
        return proposal(tokens, parents, lengths, batch.last.device)  # as wide as the fullest row

    def continuations(self, slot: int) -> tuple[Trie, float]:
        """The trie of what followed the latest tokens of the row in `slot` (its matches,
        as `propose` merges them) down to `MAX_DEPTH`, and its total weight — for a
        drafter that merges them with other candidates (`drafters.combined`). The row's
        tokens are as of the last `sync`."""
        return trie(self._occurrences(self.slots[slot]), MAX_DEPTH)

    # history --------------------------------------------------------------------------
    def remember(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Add a finished rollout of `prompt_ids` to the history, as if generated here."""
        prompt = self._prompt(tuple(prompt_ids))
        self._keep(_Row(prompt, self._new_id(), list(prompt_ids) + list(output_ids)), True)

    def state_dict(self) -> dict[str, torch.Tensor | int]:
        """The remembered rollouts, as tensors (what a checkpoint saves; between generate
        calls, when no row is live): every sequence once, the prompts in least recently
        seen order with their finished rollouts, the cross-prompt window."""
        seqs: dict[int, list[int]] = {}
        done, counts = [], []
        for prompt in self.prompts.values():
            seqs[prompt.sid] = prompt.index.seqs[prompt.sid]
            for sid in prompt.done:
                seqs[sid] = prompt.index.seqs[sid]
            done += prompt.done
            counts.append(len(prompt.done))
        starts = []
        for sid in self.recent:
            seqs[sid] = self.others.seqs[sid]
            starts.append(self.others.starts[sid])

        def t(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.long)

        return {
            "sids": t(list(seqs)),
            "lengths": t([len(x) for x in seqs.values()]),
            "tokens": t([tok for x in seqs.values() for tok in x]),
            "prompts": t([p.sid for p in self.prompts.values()]),
            "done": t(done),
            "done_counts": t(counts),
            "recent": t(list(self.recent)),
            "recent_starts": t(starts),
            "next_id": self._next_id,
        }

    def load_state_dict(self, state: dict) -> None:
        """Rebuild the history `state_dict` saved (any live rows are dropped)."""
        flat = state["tokens"].tolist()
        ends = torch.cumsum(state["lengths"], 0).tolist()
        seqs = {
            sid: flat[end - n : end]
            for sid, n, end in zip(
                state["sids"].tolist(), state["lengths"].tolist(), ends, strict=True
            )
        }
        self.prompts = OrderedDict()
        self.slots = [None] * len(self.slots)
        done = iter(state["done"].tolist())
        for psid, count in zip(
            state["prompts"].tolist(), state["done_counts"].tolist(), strict=True
        ):
            ids = tuple(seqs[psid])
            prompt = self.prompts[ids] = _Prompt(ids, SuffixIndex(N_MAX), psid)
            prompt.index.extend(psid, list(ids))
            for _ in range(count):
                sid = next(done)
                prompt.index.extend(sid, seqs[sid], len(ids) - 1)
                prompt.done.append(sid)
        self.others = SuffixIndex(N_MAX)
        self.recent = deque(state["recent"].tolist())
        for sid, start in zip(self.recent, state["recent_starts"].tolist(), strict=True):
            self.others.extend(sid, seqs[sid], start)
        self._next_id = int(state["next_id"])

    def _occurrences(self, row: _Row) -> list[Occurrence]:
        """Earlier occurrences of the row's latest tokens, longest match first, each
        weighted by its match length (a longer shared context predicts better)."""
        seq, prompt = row.tokens, row.prompt
        skip: set[int] = set()
        if "siblings" not in self.sources:
            skip |= prompt.live - {row.sid}
        if "prompt" not in self.sources:
            skip |= {row.sid, prompt.sid}
        found: list[Occurrence] = []
        seen: set[tuple[int, int]] = set()
        indexes = [prompt.index]
        if "others" in self.sources:
            indexes.append(self.others)
        for n in range(min(N_MAX, len(seq)), 0, -1):
            suffix = tuple(seq[-n:])
            for index in indexes:
                for sid, s, nxt in index.find(suffix, MATCHES - len(found), skip):
                    if (sid, nxt) not in seen:
                        seen.add((sid, nxt))
                        found.append((s, nxt, float(n)))
                if len(found) >= MATCHES:
                    return found
        return found

    def _prompt(self, ids: tuple[int, ...]) -> _Prompt:
        prompt = self.prompts.get(ids)
        if prompt is not None:
            self.prompts.move_to_end(ids)
        else:
            prompt = self.prompts[ids] = _Prompt(ids, SuffixIndex(N_MAX), self._new_id())
            prompt.index.extend(prompt.sid, list(ids))
            self._evict()
        return prompt

    def _evict(self) -> None:
        """Forget the least recently seen prompts beyond `PROMPTS` (not ones being
        generated): memory is bounded by PROMPTS x (PAST + live) rollouts, plus `WINDOW`."""
        extra = len(self.prompts) - max(PROMPTS, 1)
        for ids in list(self.prompts)[:extra] if extra > 0 else ():
            if not self.prompts[ids].live:
                del self.prompts[ids]

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id


@dataclass
class _Prompt:
    ids: tuple[int, ...]
    index: SuffixIndex
    """The prompt itself, its live rollouts and its last `past` finished ones."""
    sid: int
    """The prompt's own sequence in `index`."""
    live: set[int] = field(default_factory=set)
    """Rollouts of this prompt being generated now."""
    done: deque[int] = field(default_factory=deque)
    """Its finished rollouts in `index`, oldest first."""


@dataclass
class _Row:
    prompt: _Prompt
    sid: int
    tokens: list[int]
    """Prompt + output so far (through the row's `last`), as far as indexed."""
    new: list[int] = field(default_factory=list)
    """Output tokens read since, not yet indexed (`HistoryDrafter.sync`)."""
