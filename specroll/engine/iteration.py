"""One iteration of the engine over its slots: a prefill forward, or a decode/verify step.

`Engine` (engine/engine.py) runs per request: it admits queued requests into free slots,
collects finished rows and compacts the rest. What happens per forward lives here: the
prefill of newly admitted rows, and the decoding (k = 0) or speculative (k >= 1) step:

* prepare, on the host (`_step`): the rows' state copied to the device once
  (`Slots.load`, from `HostRows`: the host's truth), k from the depth policy within
  what the rows hold, a proposal built on the host (history, combined) or
  the drafter's host part of one made on the device (`Drafter.prepare`), the step's key;
* run, on the device (`_run`, the one function captured with CUDA graphs): a proposal
  made on the device, the target forward, verification (a chain here, a tree in
  `engine.tree_step`) and the recording of each row's verified tokens, → `StepOutputs`;
* update, on the host (`_update`): the one read of those outputs (`StepRead`) moves the
  host's rows on, the statistics and the depth policy learn, the drafter commits.

`Stepper` holds no state of its own: it is the base of `Engine`, whose model, cache,
drafter, depth policy and statistics it works on.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import torch

from specroll.drafters.base import DraftBatch, Drafter, Proposal
from specroll.engine import graphs, tree_step
from specroll.engine.depth import DepthPolicy
from specroll.engine.prompt_reuse import PromptReuse, prefill_rows
from specroll.engine.slots import Slots
from specroll.engine.step import Ran, StepInputs, StepKey, StepOutputs, StepRead
from specroll.model.kv_cache import KVCache
from specroll.model.transformer import Transformer
from specroll.spec import rng
from specroll.spec.metrics import CollapseDetector, SpecStats
from specroll.spec.sampling import Hints, RowSampling
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
    captured: graphs.Graphs | None
    reuse: PromptReuse

    def _prefill(self, st: Slots, start: int, prompts: list[list[int]]) -> None:
        """Prefill new rows at slots start.. in groups of at most `PREFILL_TOKENS`; a
        prompt this call has prefilled before is copied (`engine.prompt_reuse`)."""
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
            rows = torch.arange(start + i, start + j, **long)
            t = time.perf_counter()
            logits, hidden = prefill_rows(
                self.model, self.cache, self.reuse, group, tokens, start + i, hidden_layers
            )
            self.stats.target_s += time.perf_counter() - t
            span = range(start + i, start + j)
            st.prompts(rows, span, tokens, group)
            st.load()  # the new rows' state, for their first token
            none = torch.zeros(len(group), **long)
            ctx = self.model.cfg.max_position_embeddings
            sampling = st.sampling(rows, span)
            ver = self._verify_chain(st, rows, logits, none, None, sampling)
            read = self._accept(st, rows, span, ver, none, ctx)
            read = read.for_drafter([st.host.pos[b] for b in span])
            if self.drafter is not None:
                t = time.perf_counter()
                seqs = [p + read.entered(b) for b, p in enumerate(group)]
                self.drafter.prefill(start + i, seqs, hidden)
                self.stats.draft_s += time.perf_counter() - t
            i = j

    def _step(self, st: Slots, B: int, ctx: int) -> int:
        """One decoding (k = 0) or speculative (k >= 1) iteration of rows 0..B-1:
        prepare (host) → `_run` (device; captured with graphs on) → update (host).
        Returns the tokens emitted.

        Its wall time (draft, target forward, verification, drafter commit) goes back to
        the depth policy, which calibrates its cost model on it."""
        t_iter = time.perf_counter()
        st.load()  # the step's one copy of the rows' state to the device
        rows = st.host
        top = max(rows.pos[:B])  # the deepest row's position: sizes, room, the key axis
        # the fp32 mean of the positions (what the cost model was fitted on), from the
        # host: the sum of < 2^24 is exact in fp32, so this is the same rounded quotient
        mean_ctx = float(np.float32(sum(rows.pos[:B]) / B))
        k = self._depth(st, B, ctx, top, mean_ctx)
        hints = Hints.of(rows.params[:B])  # the processors the rows need
        inside = k > 0 and self.drafter.in_step  # the proposal is made in the step
        prop, form, proposing = None, None, 0.0
        if k > 0:
            t = time.perf_counter()
            if inside:  # what the step's shapes cannot hold, done now
                self.drafter.prepare(B, k, st.history, self.captured is not None)
            else:
                form = self.depth.forms.choose(k) if self.forms else None
                prop = self.drafter.propose(self._batch(st, B, k, hints, form))
            proposing = time.perf_counter() - t
            self.stats.draft_s += proposing
        t_proposed = time.perf_counter()
        key = self._key(B, len(st.pos), k, top, ctx, hints, prop, inside)
        t, self._proposing = time.perf_counter(), 0.0
        if self.captured is None:
            ran = self._run(st, key, StepInputs.of(B, prop, self.device))
        else:
            V = self.model.cfg.vocab_size
            buf = self.captured.buffers(key, lambda: StepInputs.new(key, V, self.device))
            buf.fill(B, prop)
            ran = self.captured.run(key, lambda: self._run(st, key, buf))
        read = StepRead.unpack(ran.packed.tolist(), key.n, B, ran.width, key.echo)  # one read
        self.stats.draft_s += self._proposing
        self.stats.target_s += time.perf_counter() - t - self._proposing
        self._update(st, range(B), read, tree=key.tree)
        if self.drafter is not None:
            t = time.perf_counter()
            hidden = {i: h[:B] for i, h in ran.hidden.items()}
            emitted = read.for_drafter(rows.pos[:B])
            self.drafter.commit(B, st.pos[:B], ran.emitted[:B], hidden, emitted)
            self.stats.draft_s += time.perf_counter() - t
        if form is not None:  # what the form measured: its proposal, the rest of the iteration
            rest = time.perf_counter() - t_proposed
            self.depth.forms.observe(self.drafter.report(), proposing, rest)
        self.depth.observe_time(B, k, mean_ctx, time.perf_counter() - t_iter)
        return sum(read.count)

    def _depth(self, st: Slots, B: int, ctx: int, top: int, mean_ctx: float) -> int:
        """The depth policy's k for this iteration, within what every row can hold: its
        k+1 positions must fit the cache and the context window, and no row drafts a
        token its budget could not keep (with r tokens to go, r - 1 drafts and the bonus
        token fill it, so acceptance counts only what could be emitted)."""
        k = self.depth.choose(B, mean_ctx)
        room = min(ctx, self.cache.max_len) - 1 - top
        # (a tree's k is its node count: only its depth is bounded by the budget)
        tree = self.drafter is not None and self.drafter.tree
        deepest = room if tree else max(st.host.left[:B]) - 1
        return max(0, min(k, room, deepest))

    def _batch(self, st: Slots, B: int, k: int, hints: Hints, form: str | None) -> DraftBatch:
        """What a drafter proposing on the host sees of rows 0..B-1."""
        return DraftBatch(
            k=k,
            num_draft=st.num_draft(B, k),
            last=st.last[:B],
            pos=st.pos[:B],
            history=st.history,
            sampling=st.sampling(slice(0, B), None, hints),
            seed=st.seed[:B],
            n_gen=st.n_gen[:B],
            pos_host=st.host.pos[:B],
            caps=st.host.caps(B, k),
            form=form,
        )

    def _key(
        self,
        B: int,
        slots: int,
        k: int,
        top: int,
        ctx: int,
        hints: Hints,
        prop: Proposal | None,
        inside: bool,
    ) -> StepKey:
        """The step's host values for B of `slots` rows: the iteration's own (eager), or
        with graphs the batch's bucket, the key bucket's axis (`engine.graphs`) and the
        drafter's epoch."""
        tree = prop is not None and prop.parents is not None
        shape = dict(
            probs=prop is not None and prop.probs is not None,
            lengths=prop is not None and prop.lengths is not None,
            tree=tree,
            inside=inside,
            echo=0 if prop is None or prop.echo is None else prop.echo.shape[1],
        )
        if self.captured is None:
            return StepKey(B, k, top, ctx, hints, **shape)
        Bb = graphs.bucket(B, slots)
        keys = graphs.key_bucket(top + k + 1, self.cache.max_len)
        # (a tree always takes lengths: it may be narrower than k)
        shape["lengths"] = shape["lengths"] or tree
        epoch = self.drafter.epoch if inside else -1  # its tensors' age
        return StepKey(Bb, k, keys - (k + 1), ctx, hints, **shape, padded=True, epoch=epoch)

    def _run(self, st: Slots, key: StepKey, buf: StepInputs) -> Ran:
        """The device step of `key`'s rows: the proposal when the drafter makes it here
        (`key.inside`), the target forward, verification (a chain, k = 0 plain, or a
        tree) and recording → (the packed `StepOutputs`, the drafter's hidden states,
        the candidates per row K + 1).
        It reads no host value but `key`'s and no device value back: eager, it runs as
        it is; with graphs, it is what is captured and replayed (`engine.graphs`), over
        the bucket's rows (past `buf.n_live`: padding) and the key bucket's axis."""
        n, k = key.n, key.k
        long = dict(dtype=torch.long, device=self.device)
        live = torch.arange(n, **long) < buf.n_live if key.padded else None  # [n]
        nd = st.num_draft(n, k)  # [n] what each row may verify
        if live is not None:
            nd = torch.where(live, nd, 0)
        if buf.lengths is not None and not key.tree:
            nd = torch.minimum(nd, buf.lengths)
        sampling = st.sampling(slice(0, n), None, key.hints)
        if live is not None:
            sampling = sampling.only(live)
        drafts, probs = buf.drafts, buf.probs
        if key.inside:
            t = time.perf_counter()  # (eager: timed; captured, this line is not replayed)
            prop = self.drafter.propose(self._inside(st, key, nd, sampling, live))
            self._proposing = time.perf_counter() - t
            drafts, probs = prop.tokens, prop.probs
            if prop.lengths is not None:  # (a chain's usable drafts: n-gram matches)
                nd = torch.minimum(nd, prop.lengths)
        args = (drafts, probs, buf.parents, buf.lengths, nd, key.max_start, key.ctx, sampling)
        outs, hidden = self._device_step(st, n, *args, live=live)
        outs.echo = buf.echo  # (what the drafter asked back rides on the one read)
        return Ran(outs.pack(), outs.emitted, hidden, outs.tokens.shape[1])

    def _inside(
        self,
        st: Slots,
        key: StepKey,
        nd: torch.Tensor,
        sampling: RowSampling,
        live: torch.Tensor | None,
    ) -> DraftBatch:
        """What a drafter proposing inside the step sees: eagerly, what the host knows of
        the rows too; captured, the fixed key axis and the live rows instead."""
        n = key.n
        pos = st.pos[:n] if live is None else torch.where(live, st.pos[:n], 0)
        batch = DraftBatch(
            key.k, nd, st.last[:n], pos, st.history, sampling, st.seed[:n], st.n_gen[:n]
        )
        if key.padded:
            batch.live, batch.keys = live, key.max_start + key.k + 1
        else:
            batch.pos_host, batch.caps = st.host.pos[:n], st.host.caps(n, key.k)
        return batch

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
    ) -> tuple[StepOutputs, dict[int, torch.Tensor]]:
        """Rows 0..n-1 (`live`: those that are not padding; None: all): drafts [n, k],
        their q [n, k, V] or None, their tree's parents [n, k] or None (a chain) →
        (their `StepOutputs`, the drafter's hidden states)."""
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
        outs = st.outputs(rows, ver, num_draft, ctx, nodes=nodes, hits=hits, live=live)
        return outs, hidden

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
    ) -> StepRead:
        """`Slots.outputs` and `_update` of a prefill's first tokens (not a speculation
        step)."""
        packed = st.outputs(rows, ver, num_draft, ctx).pack()
        read = StepRead.unpack(packed.tolist(), len(span), len(span), ver.tokens.shape[1])
        self._update(st, span, read, observe=False)
        return read

    def _update(self, st: Slots, span: range, read: StepRead, *, tree=False, observe=True) -> None:
        """The host's half of `Slots.outputs`: the rows at slots `span` (`tree`: verified as
        trees) move on in the host's state and, for a decode/verify step (`observe`),
        the statistics and the depth policy learn of the iteration."""
        st.host.advance(span, read)
        if not observe:  # (prefill is not a speculation step)
            return
        B, K, total = len(span), read.width - 1, sum(read.count)
        self.stats.observe_counts(B, K, total, read.drafted, read.accepted_at, read.drafted_at)
        self.stats.draft_nodes += sum(read.nodes)
        if read.learned:  # per position (chain), per node (tree)
            self.depth.observe_counts(B, read.learned, total)
        if tree:
            self.stats.observe_tree(B, read.learned)
        # first draft positions only: deep positions of a healthy draft are rarely
        # reached, a stale or corrupt one fails at once (history's misses are no fault)
        if self.drafter is not None and self.drafter.watch_collapse:
            pairs = list(zip(read.accepted, read.drafted, strict=True))
            self._watch(sum(d > 0 for _, d in pairs), sum(a > 0 and d > 0 for a, d in pairs))

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
