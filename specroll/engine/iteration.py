"""One iteration of the engine over its slots: a prefill forward, or a decode/verify step.

`Engine` (engine/engine.py) runs per request: it admits queued requests into free slots,
collects finished rows and compacts the rest. What happens per forward lives here: the
prefill of newly admitted rows, the decoding (k = 0) or speculative (k >= 1) step with its
draft, target forward and verification (a chain here, a tree in `engine.tree_step`), and
the recording of each row's verified tokens with the iteration's one host read-back.

`Stepper` holds no state of its own: it is the base of `Engine`, whose model, cache,
drafter, depth policy and statistics it works on.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from specroll.drafters.base import DraftBatch, Drafter, Emitted, Proposal
from specroll.engine import graphs, tree_step
from specroll.engine.depth import DepthPolicy
from specroll.engine.slots import Slots
from specroll.model.kv_cache import KVCache
from specroll.model.transformer import Transformer
from specroll.spec import rng
from specroll.spec.metrics import CollapseDetector, SpecStats
from specroll.spec.sampling import Hints, RowSampling
from specroll.spec.tree import TreeVerifyOutput
from specroll.spec.verify import VerifyOutput, verify

PREFILL_TOKENS = 8192
"""Most (padded) tokens one prefill forward may process."""


class Stepper:
    """The per-iteration steps of `Engine` (its base): prefill, decode/verify, accept."""

    model: Transformer
    device: torch.device
    cache: KVCache | None
    drafter: Drafter | None
    depth: DepthPolicy
    forms: tuple[str, ...]
    stats: SpecStats
    _collapse: CollapseDetector
    step_graphs: graphs.Graphs | None

    def _prefill(self, st: Slots, start: int, prompts: list[list[int]]) -> None:
        """Prefill new rows at slots start.. in groups of at most `PREFILL_TOKENS`."""
        hidden_layers = self.drafter.hidden_layers if self.drafter else ()
        long = dict(dtype=torch.long, device=self.device)
        i = 0
        while i < len(prompts):
            j = i + 1
            width = len(prompts[i])
            while j < len(prompts):
                w = max(width, len(prompts[j]))
                if w * (j - i + 1) > PREFILL_TOKENS:
                    break
                width, j = w, j + 1
            group = prompts[i:j]
            # one host-to-device copy of the padded prompts
            tokens = torch.tensor([p + [0] * (width - len(p)) for p in group], **long)
            lengths = torch.tensor([len(p) for p in group], **long)
            rows = torch.arange(start + i, start + j, **long)
            t = time.perf_counter()
            out = self.model(
                tokens,
                positions=torch.zeros(len(group), **long),
                cache=self.cache,
                logits_index=(lengths - 1).unsqueeze(1),
                hidden_layers=hidden_layers,
                slot_start=start + i,
                max_start=0,
            )
            self.stats.target_s += time.perf_counter() - t
            span = range(start + i, start + j)
            st.prompts(rows, span, tokens, lengths, [len(p) for p in group])
            none = torch.zeros(len(group), **long)
            ctx = self.model.cfg.max_position_embeddings
            sampling = st.sampling(rows, span)
            ver = self._verify_chain(st, rows, out.logits, none, None, sampling)
            read = self._accept(st, rows, span, ver, none, ctx)
            if self.drafter is not None:
                t = time.perf_counter()
                seqs = [p + read.entered(b) for b, p in enumerate(group)]
                self.drafter.prefill(start + i, seqs, out.hidden)
                self.stats.draft_s += time.perf_counter() - t
            i = j

    def _step(self, st: Slots, B: int, ctx: int) -> int:
        """One decoding (k = 0) or speculative (k >= 1) iteration; returns tokens emitted.

        Its wall time (draft, target forward, verification, drafter commit) goes back to
        the depth policy, which calibrates its cost model on it."""
        t_iter = time.perf_counter()
        pos_host = st.pos_host[:B]
        top = max(pos_host)  # the deepest row's position: sizes, room, the draft's key axis
        # the fp32 mean of the positions (what the cost model was fitted on), from the host
        # mirror: the sum of < 2^24 is exact in fp32, so this is the same rounded quotient
        mean_ctx = float(np.float32(sum(pos_host) / B))
        k = self.depth.choose(B, mean_ctx)
        # every row's k+1 positions must fit the cache and the context window, and no
        # row drafts a token its budget could not keep: with r tokens to go, r - 1 drafts
        # and the bonus token fill it (so acceptance counts only what could be emitted)
        room = min(ctx, self.cache.max_len) - 1 - top
        # (a tree's k is its node count: only its depth is bounded by the budget, below)
        deepest = (
            room if self.drafter is not None and self.drafter.tree else max(st.left_host[:B]) - 1
        )
        k = max(0, min(k, room, deepest))
        hints = Hints.of(st.params_host[:B])  # the processors the rows need
        sampling = st.sampling(slice(0, B), None, hints)
        prop, form = None, None
        # a drafter that proposes on the device alone does so inside the static step
        in_graph = k > 0 and self.step_graphs is not None and self.drafter.static
        # (a static step computes its rows' num_draft itself)
        num_draft = None if in_graph else st.num_draft(B, k)  # [B]
        if in_graph:
            t = time.perf_counter()
            self.drafter.prepare_static(B, k, st.history, pos_host)  # (long lags: eagerly)
            self.stats.draft_s += time.perf_counter() - t
        elif k > 0:
            form = self.depth.forms.choose(k) if self.forms else None
            t = time.perf_counter()
            prop = self.drafter.propose(
                DraftBatch(
                    k=k,
                    num_draft=num_draft,
                    last=st.last[:B],
                    pos=st.pos[:B],
                    history=st.history,
                    sampling=sampling,
                    seed=st.seed[:B],
                    n_gen=st.n_gen[:B],
                    pos_host=pos_host,
                    caps=st.caps(B, k),
                    form=form,
                )
            )
            t_proposed = time.perf_counter()
            proposing = t_proposed - t
            self.stats.draft_s += proposing
            if prop.lengths is not None and prop.parents is None:
                num_draft = torch.minimum(num_draft, prop.lengths)
        pos_before = st.pos[:B].clone()
        t = time.perf_counter()
        args = (prop, num_draft, top, ctx, sampling, in_graph)
        packed, hidden, n, K1 = self._verify(st, B, k, *args)
        self.stats.target_s += time.perf_counter() - t
        tree = prop is not None and prop.parents is not None
        read = self._read(st, range(B), packed.tolist(), n, K1, tree=tree)
        if self.drafter is not None:
            t = time.perf_counter()
            self.drafter.commit(B, pos_before, st.pos[:B] - pos_before, hidden, read)
            self.stats.draft_s += time.perf_counter() - t
        if form is not None:  # what the form measured: its proposal, the rest of the iteration
            rest = time.perf_counter() - t_proposed
            self.depth.forms.observe(self.drafter.report(), proposing, rest)
        self.depth.observe_time(B, k, mean_ctx, time.perf_counter() - t_iter)
        return sum(read.count)

    def _verify(
        self,
        st: Slots,
        B: int,
        k: int,
        prop: Proposal | None,
        num_draft: torch.Tensor | None,
        top: int,
        ctx: int,
        sampling: RowSampling,
        in_graph: bool = False,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor], int, int]:
        """The device part of an iteration of rows 0..B-1 after its proposal: the target
        forward, verification (a chain, k = 0 plain, or a tree) and recording. Returns
        (the packed read of `_record`, the drafter's hidden states of rows 0..B-1, the
        rows packed, the candidates per row K + 1). num_draft [B]: what each row may
        verify (None with `in_graph`: the proposal is made in the static step too, by
        the drafter's `propose_static`, and prop is None); sampling: the rows' settings.

        With graphs (`engine.graphs`) the same step runs over the static buffers of the
        batch's bucket: rows past B are padding, the key axis is the key bucket's, and a
        tree is walked masked to its node count."""
        long = dict(dtype=torch.long, device=self.device)
        drafts = torch.zeros(B, 0, **long) if prop is None else prop.tokens  # [B, k]
        probs = None if prop is None else prop.probs  # [B, k, V]
        lengths = None if prop is None else prop.lengths  # [B]
        parents = None if prop is None else prop.parents  # [B, k]
        if self.step_graphs is None:
            args = (drafts, probs, parents, lengths, num_draft, top, ctx, sampling)
            packed, hidden, K1 = self._device_step(st, B, *args)
            return packed, hidden, B, K1
        Bb = graphs.bucket(B, st.pos.shape[0])
        hints = sampling.hints  # the processors the live rows need
        keys = graphs.key_bucket(top + k + 1, self.cache.max_len)  # the key axis
        tree = parents is not None  # (a tree always takes lengths: it may be narrower than k)
        shape = (probs is not None, lengths is not None or tree, tree)
        epoch = self.drafter.epoch if in_graph else -1  # its tensors' age
        key = (Bb, k, keys, *shape, hints, epoch)
        V = self.model.cfg.vocab_size
        buf = self.step_graphs.buffers(key, lambda: graphs.Inputs.new(Bb, k, V, *shape, **long))
        buf.fill(B, drafts, probs, lengths, parents)

        def step() -> tuple[torch.Tensor, dict[int, torch.Tensor], int]:
            live = torch.arange(Bb, **long) < buf.n_live  # [Bb]
            nd = torch.where(live, st.num_draft(Bb, k), 0)
            if buf.lengths is not None and buf.parents is None:
                nd = torch.minimum(nd, buf.lengths)
            padded = st.sampling(slice(0, Bb), None, hints).only(live)  # [Bb] rows
            drafts, probs = buf.drafts, buf.probs
            if in_graph:
                pos = torch.where(live, st.pos[:Bb], 0)
                last, seed, n_gen = st.last[:Bb], st.seed[:Bb], st.n_gen[:Bb]
                batch = DraftBatch(k, nd, last, pos, st.history, padded, seed, n_gen)
                prop = self.drafter.propose_static(batch, live, keys)
                drafts, probs = prop.tokens, prop.probs
                if prop.lengths is not None:  # (a chain's usable drafts: n-gram matches)
                    nd = torch.minimum(nd, prop.lengths)
            start = keys - (k + 1)  # the `max_start` that gives that key axis
            args = (drafts, probs, buf.parents, buf.lengths, nd, start, ctx, padded)
            return self._device_step(st, Bb, *args, live=live)

        packed, hidden, K1 = self.step_graphs.run(key, step)
        if in_graph:
            self.drafter.after_static(B, k, st.pos_host[:B])
        return packed, {i: h[:B] for i, h in hidden.items()}, Bb, K1

    def _device_step(
        self,
        st: Slots,
        n: int,
        drafts: torch.Tensor,
        probs: torch.Tensor | None,
        parents: torch.Tensor | None,
        lengths: torch.Tensor | None,
        num_draft: torch.Tensor,
        max_start: int,
        ctx: int,
        sampling: RowSampling,
        live: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor], int]:
        """Rows 0..n-1 (`live`: those that are not padding; None: all): drafts [n, k],
        their q [n, k, V] or None, their tree's parents [n, k] or None (a chain) →
        (the packed read, hidden states, K + 1). No host read, no host value but the
        shapes and max_start: what a CUDA graph can hold."""
        rows = torch.arange(n, device=self.device)
        layers = self.drafter.hidden_layers if self.drafter else ()
        hits = None
        if parents is not None:
            args = (drafts, parents, lengths, num_draft, layers, max_start, sampling, live)
            ver, num_draft, nodes, hidden = tree_step.run(self.model, self.cache, st, n, *args)
            # [k] rows whose accepted path went through node i + 1 (adaptive tree size)
            on_path = torch.zeros(n, drafts.shape[1] + 1, dtype=torch.long, device=self.device)
            on_path.scatter_(1, ver.path, 1)  # (a padding row's path is its root only)
            hits = on_path[:, 1:].sum(0)
        else:
            pos = st.pos[:n] if live is None else torch.where(live, st.pos[:n], 0)
            out = self.model(
                torch.cat([st.last[:n, None], drafts], dim=1),  # [n, k+1]
                positions=pos,
                cache=self.cache,
                hidden_layers=layers,
                max_start=max_start,
            )
            ver = self._verify_chain(st, rows, out.logits, num_draft, (drafts, probs), sampling)
            nodes, hidden = num_draft, out.hidden
        packed = self._record(st, rows, ver, num_draft, ctx, nodes=nodes, hits=hits, live=live)
        return packed, hidden, ver.tokens.shape[1]

    def _verify_chain(
        self,
        st: Slots,
        rows: torch.Tensor,
        logits: torch.Tensor,
        num_draft: torch.Tensor,
        proposal: tuple[torch.Tensor, torch.Tensor | None] | None,
        sampling: RowSampling,
    ) -> VerifyOutput:
        """Verify a chain of drafts per row (none at prefill). rows: [n] the slots (on
        the device); logits: [n, k+1, V] target logits at `last` and each draft."""
        n, K1, _ = logits.shape
        K = K1 - 1
        long = dict(dtype=torch.long, device=self.device)
        if proposal is None:
            proposal = (torch.zeros(n, 0, **long), None)
        drafts, probs = proposal
        n_gen, seed = st.n_gen[rows], st.seed[rows]
        idx = n_gen.unsqueeze(1) + torch.arange(K1, **long)  # [n, K+1] output index of each
        return verify(
            logits,
            drafts,
            num_draft,
            probs,
            sampling,
            rng.uniforms(seed, idx[:, :K], rng.ACCEPT),
            rng.uniforms(seed, idx, rng.SAMPLE),
        )

    def _accept(
        self,
        st: Slots,
        rows: torch.Tensor,
        span: range,
        ver: VerifyOutput,
        num_draft: torch.Tensor,
        ctx: int,
    ) -> Emitted:
        """`_record` and `_read` of a prefill's first tokens (not a speculation step)."""
        packed = self._record(st, rows, ver, num_draft, ctx)
        return self._read(st, span, packed.tolist(), len(span), ver.tokens.shape[1], observe=False)

    def _record(
        self,
        st: Slots,
        rows: torch.Tensor,
        ver: VerifyOutput | TreeVerifyOutput,
        num_draft: torch.Tensor,
        ctx: int,
        nodes: torch.Tensor | None = None,
        hits: torch.Tensor | None = None,
        live: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Record each row's verified tokens up to its first stop condition, on the device.

        rows: [n] the slots; ver: the verification of K drafted positions per row (chain
        or tree), num_draft [n] the positions each row drafted, nodes [n] the candidates
        it verified (a tree's may exceed num_draft; None: none), hits [k] per tree node
        the rows whose accepted path went through it (what the depth policy learns from a
        tree), live [n] the rows that are not padding (None: all). Every row advances its
        cache position by the tokens that entered the cache (`last` + accepted drafts).

        Returns what the host needs to learn of the iteration — positions, tokens, finish
        codes, the speculation counters — packed in one tensor, which `_read` reads back
        once: on a GPU, the one stall of an iteration (`engine.syncs`), and all that
        drafters working on the host (history) learn of it.
        """
        n, K1 = ver.tokens.shape
        long = dict(dtype=torch.long, device=self.device)
        idx = st.n_gen[rows].unsqueeze(1) + torch.arange(K1, **long)  # [n, K+1] output index
        emitted = ver.num_emitted  # [n]
        out = ver.tokens.clamp(min=0)  # [n, K+1]
        if live is not None:  # padding rows emit nothing and keep nothing
            emitted = torch.where(live, emitted, 0)
        count, finish = st.cut(rows, out, emitted, ctx)
        if live is not None:
            count = torch.where(live, count, 0)
            finish = torch.where(live, finish, st.finish[rows])
        st.record(rows, idx, out, ver.logprobs, emitted, count, finish, live)
        drafted = st.count_drafts(rows, num_draft, ver.num_accepted, ver.accepted)
        if nodes is None:
            nodes = torch.zeros_like(num_draft)
        parts = [emitted, count, finish, num_draft, ver.num_accepted, nodes, out.flatten()]
        if drafted is not None:  # per-position totals: statistics, depth policy
            parts += [ver.accepted.sum(0), drafted.sum(0), (ver.accepted & drafted).sum(0)]
            if hits is not None:
                parts.append(hits)
        return torch.cat(parts)

    def _read(
        self,
        st: Slots,
        span: range,
        host: list[int],
        n: int,
        K1: int,
        tree: bool = False,
        observe: bool = True,
    ) -> Emitted:
        """The host's half of `_record`: `host` is its packed tensor, read back, for n
        rows (the first len(span) of them live, at slots `span`) of K1 candidates each
        (`tree`: with per-node hits). Brings the slots' host mirrors up to date and, for
        a decode/verify step (`observe`), the statistics and the depth policy."""
        B, K = len(span), K1 - 1
        h_emit, h_count, h_finish, h_draft, h_acc, h_nodes = (
            host[i * n : i * n + B] for i in range(6)
        )
        st.mirror(span, h_emit, h_count, h_finish)
        read = Emitted([st.pos_host[b] for b in span], h_emit, h_count, host[6 * n :][: B * K1], K1)
        total = sum(h_count)
        if observe:  # decode/verify forward (prefill is not a speculation step)
            per_pos = host[6 * n + n * K1 :]
            acc_pos, drafted_pos = per_pos[:K], per_pos[K : 2 * K]
            # what the depth policy learns: per position (chain), per node (tree)
            acc_drafted = per_pos[3 * K :] if tree else per_pos[2 * K : 3 * K]
            self.stats.observe_counts(B, K, total, h_draft, acc_pos, drafted_pos)
            self.stats.draft_nodes += sum(h_nodes)
            if acc_drafted:
                self.depth.observe_counts(B, acc_drafted, total)
            if tree:
                self.stats.observe_tree(B, acc_drafted)
            # first draft positions only: deep positions of a healthy draft are rarely
            # reached, a stale or corrupt one fails at once (history's misses are no fault)
            if self.drafter is not None and self.drafter.watch_collapse:
                self._watch(
                    sum(d > 0 for d in h_draft),
                    sum(a > 0 and d > 0 for a, d in zip(h_acc, h_draft, strict=True)),
                )
        return read

    def _watch(self, drafted: int, first_accepted: int) -> None:
        """Rows that drafted this iteration, and those whose first draft token was kept."""
        if self._collapse.observe(drafted, first_accepted):
            warnings.warn(
                f"acceptance collapse: drafter {self.drafter.name!r} (weight version "
                f"{self.drafter.version}) had its first token accepted in "
                f"{self._collapse.accepted} of the last {self._collapse.drafted} drafts; "
                "is the draft stale or corrupt?",
                RuntimeWarning,
                stacklevel=3,
            )
            self._collapse = CollapseDetector(self._collapse.window, self._collapse.threshold)
