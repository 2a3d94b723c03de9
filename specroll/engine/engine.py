"""The rollout engine: continuous batching over a fixed number of KV-cache slots.

Active rows always occupy slots 0..B-1. A finished row frees its slot at once: the last
active row's cache and state move into it (compaction), and queued requests are
prefilled, together, into the free slots behind the rows already decoding. Per-row state
(position, last token, sampling parameters, seed, outputs) lives in slot-indexed tensors,
so a decoding step is a handful of tensor ops whatever the batch size; Python only runs
per request (admission, completion), never per token.

Speculative mode is the same loop: each iteration the depth policy picks k, the drafter
proposes up to k tokens per row, one target forward scores every row's k+1 positions at
its own cache position, `spec.verify` accepts, and each row advances by what it
emitted (rejected cache entries are simply overwritten later). Plain decoding is the
k = 0 case of that step and draws the very same random numbers, so turning speculation
off changes nothing but speed. A drafter may propose a tree of candidates instead of a
chain (`Proposal.parents`): `engine.tree_step` scores it in one forward and walks it
(`spec.tree`), and the iteration is recorded as a chain's.

Randomness comes from counter-based uniforms keyed by (request seed, token index): a
request's tokens do not depend on which other requests share its batch.

Devices and dtypes: the engine runs where its model's parameters are (`Engine.device`)
and every slot tensor, index, mask and random stream is made there; only request seeds
(drawn on a CPU generator) and results (`.tolist()`) are host-side. The KV cache has the
weights' dtype (bf16 weights: a bf16 cache); logits are fp32 before any sampling or
verification (`ModelOutput.logits`), so a bf16 engine samples its own bf16 model's
distribution exactly.

Run it: `specroll generate --prompt "What is 7 times 8?"`.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specroll.drafters.base import DraftBatch, Drafter, Proposal
from specroll.engine import tree_step
from specroll.engine.depth import AdaptiveDepth, FixedDepth
from specroll.engine.heap import young_heap_only
from specroll.engine.request import Request, Result, Results, check_prompts, request_seeds
from specroll.engine.slots import Slots
from specroll.model.kv_cache import KVCache
from specroll.model.transformer import Transformer
from specroll.model.weights import load_state
from specroll.spec import rng
from specroll.spec.metrics import CollapseDetector, SpecStats
from specroll.spec.tree import TreeVerifyOutput
from specroll.spec.verify import VerifyOutput, verify


@dataclass
class EngineConfig:
    """Rollout engine settings."""

    max_batch: int = 32
    """Cache slots: the most requests decoded together."""
    prefill_tokens: int = 8192
    """Most (padded) tokens one prefill forward may process."""
    seed: int = 0
    """Seeds requests that carry none (in submission order)."""

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {self.prefill_tokens}")


class Engine:
    """Generates completions for batches of requests with one policy model.

    With a `drafter`, decoding is speculative with the depth chosen per iteration by
    `depth` (default: k = 3 at every batch size); `stats` holds the last call's metrics.
    """

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig | None = None,
        drafter: Drafter | None = None,
        depth: FixedDepth | AdaptiveDepth | None = None,
    ) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        """Where the engine's tensors live: its model's device."""
        self.config = config or EngineConfig()
        self.cache: KVCache | None = None
        self.eos = tuple(model.cfg.eos_token_id)
        self.drafter = drafter
        self.depth = depth if depth is not None else FixedDepth(k=3 if drafter else 0)
        if self.depth.k_max > 0 and drafter is None:
            raise ValueError(f"depth k={self.depth.k_max} needs a drafter")
        ctx = model.cfg.max_position_embeddings
        if self.depth.k_max >= ctx:  # every slot buffer has k_max columns of slack
            raise ValueError(
                f"depth k={self.depth.k_max} cannot fit the context window of {ctx} "
                f"positions (a row's k + 1 candidates need k + 1 of them); at most {ctx - 1}"
            )
        self.stats = SpecStats()
        self._collapse = CollapseDetector()
        self.policy_version = 0
        """Version of the policy weights (set by `load_weights`; reported in every Result)."""

    # ------------------------------------------------------------------ public API

    def load_weights(
        self,
        version: int,
        policy: dict[str, torch.Tensor],
        draft: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """New weights (tensors by name) under `version`, which every later Result
        carries as its policy (and draft) version; then prepacked (`warm`).

        They are copied into the engine's own tensors in place: names and shapes must be
        the engine's (ValueError names the first that differs). `draft` goes into the
        drafter's network; None keeps the draft weights as they are."""
        load_state(self.model, policy, "policy")
        if draft is not None:
            net = None if self.drafter is None else self.drafter.network
            if net is None:
                raise ValueError("draft weights given, but this engine's drafter has none")
            load_state(net, draft, "draft")
        self.policy_version = version
        if self.drafter is not None:
            self.drafter.version = version
        self.warm()

    @torch.no_grad()
    def warm(self) -> None:
        """Prepack the weights now (weight sync calls this after loading new ones), so the
        first iteration of the next `generate` does not pay it: a generation timing then
        measures generation, and speculative and plain engines sharing the weights are
        timed alike."""
        self.model.packed_weights()
        if self.drafter is not None:
            self.drafter.warm()

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[Request],
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Results:
        """Run every request to completion; results come back in request order, with
        this call's speculation metrics in `.stats` (also kept in `self.stats`).

        on_progress(new_tokens, finished_requests) is called after every forward.
        """
        if not requests:
            return Results()
        cfg = self.model.cfg
        check_prompts(requests, cfg.max_position_embeddings, cfg.vocab_size)
        seeds = request_seeds(requests, self.config.seed)
        ctx = cfg.max_position_embeddings
        max_gen = max(r.params.max_new_tokens for r in requests)
        need_len = max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests)
        # verification writes up to k_max positions past a row's last emitted token
        need_len = min(ctx, need_len + self.depth.k_max)
        n_slots = min(self.config.max_batch, len(requests))
        self._ensure_cache(n_slots, need_len)
        # no row generates past its cache row: a larger budget sizes nothing (`Slots`)
        max_gen = min(max_gen, self.cache.max_len)
        stops = [r.params.stops(self.eos) for r in requests]
        st = Slots(
            n_slots,
            max_gen,
            max(len(s) for s in stops),
            self.cache.max_len,
            self.depth.k_max,
            self.device,
        )
        if self.drafter is not None:
            self.drafter.start(self.cache.num_slots, self.cache.max_len)
        self.stats = SpecStats()
        versions = (self.policy_version, None if self.drafter is None else self.drafter.version)

        # collection passes inside the loop skip the long-lived heap (`engine.heap`)
        with young_heap_only():
            t0 = time.perf_counter()
            first_token = [0.0] * len(requests)
            results: list[Result | None] = [None] * len(requests)
            queue = deque(range(len(requests)))
            B = 0
            while queue or B:
                if queue and n_slots > B:
                    new = [queue.popleft() for _ in range(min(n_slots - B, len(queue)))]
                    for i, j in enumerate(new):
                        st.admit(B + i, requests[j].params, j, seeds[j], stops[j])
                    self._prefill(st, B, [requests[j].prompt_ids for j in new])
                    now = time.perf_counter() - t0
                    for j in new:
                        first_token[j] = now
                    stepped = len(new)
                    B += len(new)
                else:
                    stepped = self._step(st, B, ctx)
                done = st.finished(B)
                for b in sorted(done, reverse=True):
                    j = st.request[b]
                    results[j] = st.result(b, requests[j], seeds[j], done[b], versions)
                    if self.drafter is not None:
                        self.drafter.release(b, len(results[j].token_ids))
                    results[j].first_token_s = first_token[j]
                    results[j].latency_s = time.perf_counter() - t0
                    B -= 1
                    if b != B:  # compact: the last active row takes the freed slot
                        self.cache.move(B, b, st.pos_host[B])
                        st.move(B, b)
                        if self.drafter is not None:
                            self.drafter.move(B, b)
                if on_progress is not None:
                    on_progress(stepped, len(done))
        self.stats.total_s = time.perf_counter() - t0
        return Results(results, self.stats)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ steps

    def _prefill(self, st: Slots, start: int, prompts: list[list[int]]) -> None:
        """Prefill new rows at slots start.. in groups of at most prefill_tokens."""
        hidden_layers = self.drafter.hidden_layers if self.drafter else ()
        long = dict(dtype=torch.long, device=self.device)
        i = 0
        while i < len(prompts):
            j = i + 1
            width = len(prompts[i])
            while j < len(prompts):
                w = max(width, len(prompts[j]))
                if w * (j - i + 1) > self.config.prefill_tokens:
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
            ver = self._verify_chain(st, rows, span, out.logits, none, None)
            _, first = self._accept(st, rows, span, ver, none, ctx, observe=False)
            if self.drafter is not None:
                t = time.perf_counter()
                seqs = [p + [x] for p, x in zip(group, first, strict=True)]
                self.drafter.prefill(start + i, seqs, out.hidden)
                self.stats.draft_s += time.perf_counter() - t
            i = j

    def _step(self, st: Slots, B: int, ctx: int) -> int:
        """One decoding (k = 0) or speculative (k >= 1) iteration; returns tokens emitted.

        Its wall time (draft, target forward, verification, drafter commit) goes back to
        the depth policy, which calibrates its cost model on it."""
        t_iter = time.perf_counter()
        long = dict(dtype=torch.long, device=self.device)
        rows = torch.arange(B, **long)
        pos_host = st.pos_host[:B]
        # the fp32 mean of the positions (what the cost model was fitted on), from the host
        # mirror: the sum of < 2^24 is exact in fp32, so this is the same rounded quotient
        mean_ctx = float(np.float32(sum(pos_host) / B))
        k = self.depth.choose(B, mean_ctx)
        # every row's k+1 positions must fit the cache and the context window, and no
        # row drafts a token its budget could not keep: with r tokens to go, r - 1 drafts
        # and the bonus token fill it (so acceptance counts only what could be emitted)
        room = min(ctx, self.cache.max_len) - 1 - max(pos_host)
        # (a tree's k is its node count: only its depth is bounded by the budget, below)
        deepest = (
            room if self.drafter is not None and self.drafter.tree else max(st.left_host[:B]) - 1
        )
        k = max(0, min(k, room, deepest))
        num_draft = st.max_draft[:B].clamp(max=k)  # [B] per-request cap, -1 = no cap
        num_draft = torch.where(num_draft < 0, k, num_draft)
        num_draft = torch.minimum(num_draft, st.max_new[:B] - st.n_gen[:B] - 1)
        drafts, probs, prop = torch.zeros(B, k, **long), None, None
        if k > 0:
            t = time.perf_counter()
            prop = self.drafter.propose(
                DraftBatch(
                    k=k,
                    num_draft=num_draft,
                    last=st.last[:B],
                    pos=st.pos[:B],
                    history=st.history,
                    sampling=st.sampling(slice(0, B), range(B)),
                    seed=st.seed[:B],
                    n_gen=st.n_gen[:B],
                )
            )
            self.stats.draft_s += time.perf_counter() - t
            drafts, probs = prop.tokens, prop.probs
            if prop.lengths is not None and prop.parents is None:
                num_draft = torch.minimum(num_draft, prop.lengths)
        pos_before = st.pos[:B].clone()
        hits = None
        if prop is not None and prop.parents is not None:
            ver, num_draft, nodes, hidden = self._verify_tree(st, B, prop, num_draft)
            # [k] rows whose accepted path went through node i + 1 (adaptive tree size)
            on_path = torch.zeros(B, k + 1, **long).scatter_(1, ver.path, 1)
            hits = on_path[:, 1:].sum(0)
        else:
            tokens = torch.cat([st.last[:B, None], drafts], dim=1)  # [B, k+1]
            t = time.perf_counter()
            out = self.model(
                tokens,
                positions=st.pos[:B],
                cache=self.cache,
                hidden_layers=self.drafter.hidden_layers if self.drafter else (),
                max_start=max(pos_host),
            )
            self.stats.target_s += time.perf_counter() - t
            ver = self._verify_chain(st, rows, range(B), out.logits, num_draft, (drafts, probs))
            nodes, hidden = num_draft, out.hidden
        emitted, _ = self._accept(st, rows, range(B), ver, num_draft, ctx, nodes=nodes, hits=hits)
        if self.drafter is not None:
            t = time.perf_counter()
            self.drafter.commit(B, pos_before, st.pos[:B] - pos_before, hidden, st.history)
            self.stats.draft_s += time.perf_counter() - t
        self.depth.observe_time(B, k, mean_ctx, time.perf_counter() - t_iter)
        return emitted

    def _verify_chain(
        self,
        st: Slots,
        rows: torch.Tensor,
        span: range,
        logits: torch.Tensor,
        num_draft: torch.Tensor,
        proposal: tuple[torch.Tensor, torch.Tensor | None] | None,
    ) -> VerifyOutput:
        """Verify a chain of drafts per row (none at prefill). rows: [n] the slots (on
        the device); span: the same slots on the host. logits: [n, k+1, V] target logits
        at `last` and each draft."""
        n, K1, _ = logits.shape
        K = K1 - 1
        long = dict(dtype=torch.long, device=self.device)
        if proposal is None:
            proposal = (torch.zeros(n, 0, **long), None)
        drafts, probs = proposal
        n_gen, seed = st.n_gen[rows], st.seed[rows]
        idx = n_gen.unsqueeze(1) + torch.arange(K1, **long)  # [n, K+1] output index of each slot
        return verify(
            logits,
            drafts,
            num_draft,
            probs,
            st.sampling(rows, span),
            rng.uniforms(seed, idx[:, :K], rng.ACCEPT),
            rng.uniforms(seed, idx, rng.SAMPLE),
        )

    def _verify_tree(
        self, st: Slots, B: int, prop: Proposal, num_draft: torch.Tensor
    ) -> tuple[TreeVerifyOutput, torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """`engine.tree_step.run` on rows 0..B-1, timed as a target forward."""
        t = time.perf_counter()
        out = tree_step.run(self.model, self.cache, st, B, prop, num_draft, self.drafter)
        self.stats.target_s += time.perf_counter() - t
        return out

    def _accept(
        self,
        st: Slots,
        rows: torch.Tensor,
        span: range,
        ver: VerifyOutput | TreeVerifyOutput,
        num_draft: torch.Tensor,
        ctx: int,
        observe: bool = True,
        nodes: torch.Tensor | None = None,
        hits: torch.Tensor | None = None,
    ) -> tuple[int, list[int]]:
        """Record each row's verified tokens up to its first stop condition.

        rows: [n] the slots (on the device); span: the same slots on the host. ver: the
        verification of K drafted positions per row (chain or tree), num_draft [n] the
        positions each row drafted, nodes [n] the candidates it verified (a tree's may
        exceed num_draft; None: none), hits [k] per tree node the rows whose accepted path
        went through it (what the depth policy learns from a tree). Every row advances its
        cache position by the tokens that entered the cache (`last` + accepted drafts).
        Returns (tokens recorded, each row's new `last`).

        The host learns what it needs of the iteration — positions, finish codes, the
        speculation counters — from one read-back of a packed tensor: on a GPU, the one
        stall of an iteration here (`engine.syncs`).
        """
        n, K1 = ver.tokens.shape
        K = K1 - 1
        long = dict(dtype=torch.long, device=self.device)
        idx = st.n_gen[rows].unsqueeze(1) + torch.arange(K1, **long)  # [n, K+1] output index
        emitted = ver.num_emitted  # [n]
        out = ver.tokens.clamp(min=0)  # [n, K+1]
        count, finish = st.cut(rows, out, emitted, ctx)
        last = st.record(rows, idx, out, ver.logprobs, emitted, count, finish)
        drafted = st.count_drafts(rows, num_draft, ver.num_accepted, ver.accepted)
        if nodes is None:
            nodes = torch.zeros_like(num_draft)
        parts = [emitted, count, finish, num_draft, ver.num_accepted, last, nodes]
        if drafted is not None and observe:  # per-position totals: statistics, depth policy
            parts += [ver.accepted.sum(0), drafted.sum(0), (ver.accepted & drafted).sum(0)]
            if hits is not None:
                parts.append(hits)
        host = torch.cat(parts).tolist()  # the iteration's one read-back
        h_emit, h_count, h_finish, h_draft, h_acc, h_last, h_nodes = (
            host[i * n : (i + 1) * n] for i in range(7)
        )
        st.mirror(span, h_emit, h_count, h_finish)
        total = sum(h_count)
        if observe:  # decode/verify forward (prefill is not a speculation step)
            per_pos = host[7 * n :]
            acc_pos, drafted_pos = per_pos[:K], per_pos[K : 2 * K]
            # what the depth policy learns: per position (chain), per node (tree)
            acc_drafted = per_pos[3 * K :] if hits is not None else per_pos[2 * K : 3 * K]
            self.stats.observe_counts(n, K, total, h_draft, acc_pos, drafted_pos)
            self.stats.draft_nodes += sum(h_nodes)
            if acc_drafted:
                self.depth.observe_counts(n, acc_drafted, total)
            if hits is not None:
                self.stats.observe_tree(n, acc_drafted)
            # first draft positions only: deep positions of a healthy draft are rarely
            # reached, a stale or corrupt one fails at once (history's misses are no fault)
            if self.drafter is not None and self.drafter.watch_collapse:
                self._watch(
                    sum(d > 0 for d in h_draft),
                    sum(a > 0 and d > 0 for a, d in zip(h_acc, h_draft, strict=True)),
                )
        return total, h_last

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

    # ------------------------------------------------------------------ bookkeeping

    def _ensure_cache(self, slots: int, length: int) -> None:
        c = self.cache
        if c is not None and c.num_slots >= slots and c.max_len >= length:
            return
        if c is not None:
            slots, length = max(slots, c.num_slots), max(length, c.max_len)
        length = min(-(-length // 64) * 64, self.model.cfg.max_position_embeddings)
        self.cache = None  # free the old one first
        dtype = next(self.model.parameters()).dtype
        self.cache = KVCache(self.model.cfg, slots, length, dtype=dtype, device=self.device)
