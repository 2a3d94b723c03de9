"""The rollout engine: continuous batching over a fixed number of KV-cache slots.

Active rows always occupy slots 0..B-1. A finished row frees its slot at once: the last
active row's cache and state move into it (compaction), and queued requests are
prefilled, together, into the free slots behind the rows already decoding. Per-row state
(position, last token, sampling parameters, seed, outputs) lives in slot-indexed tensors,
so a decoding step is a handful of tensor ops whatever the batch size; Python only runs
per request (admission, completion), never per token.

Randomness comes from counter-based uniforms keyed by (request seed, token index): a
request's tokens do not depend on which other requests share its batch.

Run it: `specroll generate --prompt "What is 7 times 8?"`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specroll.engine.request import Request, Result
from specroll.model.transformer import KVCache, Transformer
from specroll.spec import rng
from specroll.spec.sampling import sample


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


class _Slots:
    """Slot-indexed state of the rows being decoded (row b = slot b)."""

    def __init__(self, n: int, max_gen: int, max_stops: int) -> None:
        long = dict(dtype=torch.long)
        self.pos = torch.zeros(n, **long)  # tokens already in the cache
        self.last = torch.zeros(n, **long)  # newest token, not yet in the cache
        self.n_gen = torch.zeros(n, **long)
        self.max_new = torch.zeros(n, **long)
        self.seed = torch.zeros(n, **long)
        self.temperature = torch.zeros(n)
        self.top_k = torch.zeros(n, **long)
        self.top_p = torch.ones(n)
        self.stops = torch.full((n, max(max_stops, 1)), -1, **long)
        self.tokens = torch.zeros(n, max_gen, **long)  # [S, max_gen]
        self.logprobs = torch.zeros(n, max_gen)  # [S, max_gen]
        self.request = [-1] * n

    def tensors(self) -> list[torch.Tensor]:
        return [v for v in vars(self).values() if isinstance(v, torch.Tensor)]

    def move(self, src: int, dst: int) -> None:
        for t in self.tensors():
            t[dst] = t[src]
        self.request[dst] = self.request[src]


class Engine:
    """Generates completions for batches of requests with one policy model."""

    def __init__(self, model: Transformer, config: EngineConfig | None = None) -> None:
        self.model = model.eval()
        self.config = config or EngineConfig()
        self.cache: KVCache | None = None
        self.eos = tuple(model.cfg.eos_token_id)

    # ------------------------------------------------------------------ public API

    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[Request],
        on_progress: Callable[[int, int], None] | None = None,
    ) -> list[Result]:
        """Run every request to completion; results come back in request order.

        on_progress(new_tokens, finished_requests) is called after every forward.
        """
        if not requests:
            return []
        seeds = self._check(requests)
        ctx = self.model.cfg.max_position_embeddings
        max_gen = max(r.params.max_new_tokens for r in requests)
        need_len = min(ctx, max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests))
        n_slots = min(self.config.max_batch, len(requests))
        self._ensure_cache(n_slots, need_len)
        stops = [self._stops(r) for r in requests]
        st = _Slots(n_slots, max_gen, max(len(s) for s in stops))

        t0 = time.perf_counter()
        first_token = [0.0] * len(requests)
        results: list[Result | None] = [None] * len(requests)
        queue = deque(range(len(requests)))
        B = 0
        while queue or B:
            if queue and n_slots > B:
                new = [queue.popleft() for _ in range(min(n_slots - B, len(queue)))]
                for i, j in enumerate(new):
                    self._admit(st, B + i, requests[j], j, seeds[j], stops[j])
                self._prefill(st, B, [requests[j].prompt_ids for j in new])
                now = time.perf_counter() - t0
                for j in new:
                    first_token[j] = now
                stepped = len(new)
                B += len(new)
            else:
                self._decode(st, B)
                stepped = B
            done = self._finished(st, B, ctx)
            for b in sorted(done, reverse=True):
                j = st.request[b]
                results[j] = self._result(st, b, requests[j], j, seeds[j], done[b])
                results[j].first_token_s = first_token[j]
                results[j].latency_s = time.perf_counter() - t0
                B -= 1
                if b != B:  # compact: the last active row takes the freed slot
                    self.cache.move(B, b, int(st.pos[B]))
                    st.move(B, b)
            if on_progress is not None:
                on_progress(stepped, len(done))
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ steps

    def _prefill(self, st: _Slots, start: int, prompts: list[list[int]]) -> None:
        """Prefill new rows at slots start.. in groups of at most prefill_tokens."""
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
            tokens = torch.zeros(len(group), width, dtype=torch.long)
            for r, p in enumerate(group):
                tokens[r, : len(p)] = torch.tensor(p)
            lengths = torch.tensor([len(p) for p in group])
            out = self.model(
                tokens,
                positions=torch.zeros(len(group), dtype=torch.long),
                cache=self.cache,
                logits_index=(lengths - 1).unsqueeze(1),
                slot_start=start + i,
            )
            rows = torch.arange(start + i, start + j)
            st.pos[rows] = lengths
            self._emit(st, rows, out.logits[:, 0])
            i = j

    def _decode(self, st: _Slots, B: int) -> None:
        """One token for every active row."""
        out = self.model(st.last[:B, None], positions=st.pos[:B], cache=self.cache)
        st.pos[:B] += 1
        self._emit(st, torch.arange(B), out.logits[:, 0])

    def _emit(self, st: _Slots, rows: torch.Tensor, logits: torch.Tensor) -> None:
        """Sample the next token of `rows` from `logits` ([n, V]) and record it."""
        u = rng.uniforms(st.seed[rows], st.n_gen[rows], rng.SAMPLE)
        ids, lp = sample(logits, st.temperature[rows], st.top_k[rows], st.top_p[rows], u)
        st.tokens[rows, st.n_gen[rows]] = ids
        st.logprobs[rows, st.n_gen[rows]] = lp
        st.last[rows] = ids
        st.n_gen[rows] += 1

    def _finished(self, st: _Slots, B: int, ctx: int) -> dict[int, str]:
        """Rows that are done after this step, with their finish reason."""
        stop = (st.last[:B, None] == st.stops[:B]).any(dim=1)
        length = st.n_gen[:B] >= st.max_new[:B]
        context = st.pos[:B] + 1 >= ctx
        any_done = stop | length | context
        if not bool(any_done.any()):
            return {}
        reasons = {}
        for b in any_done.nonzero().flatten().tolist():
            reasons[b] = "stop" if stop[b] else ("length" if length[b] else "context")
        return reasons

    # ------------------------------------------------------------------ bookkeeping

    def _admit(
        self, st: _Slots, b: int, req: Request, j: int, seed: int, stops: tuple[int, ...]
    ) -> None:
        p = req.params
        st.request[b] = j
        st.n_gen[b] = 0
        st.max_new[b] = p.max_new_tokens
        st.seed[b] = seed
        st.temperature[b] = p.temperature
        st.top_k[b] = p.top_k
        st.top_p[b] = p.top_p
        st.stops[b] = -1
        if stops:
            st.stops[b, : len(stops)] = torch.tensor(stops)

    def _result(self, st: _Slots, b: int, req: Request, j: int, seed: int, reason: str) -> Result:
        n = int(st.n_gen[b])
        return Result(
            request_id=j if req.request_id is None else req.request_id,
            prompt_ids=list(req.prompt_ids),
            token_ids=st.tokens[b, :n].tolist(),
            logprobs=st.logprobs[b, :n].tolist(),
            finish_reason=reason,
            seed=seed,
            first_token_s=0.0,
            latency_s=0.0,
        )

    def _stops(self, req: Request) -> tuple[int, ...]:
        ids = req.params.stop_token_ids
        return self.eos if ids is None else ids

    def _check(self, requests: Sequence[Request]) -> list[int]:
        """Validate prompts against the model and fix every request's seed."""
        cfg = self.model.cfg
        gen = torch.Generator().manual_seed(self.config.seed)
        seeds = []
        for i, r in enumerate(requests):
            n = len(r.prompt_ids)
            if n == 0:
                raise ValueError(f"request {i}: prompt_ids is empty")
            if n >= cfg.max_position_embeddings:
                raise ValueError(
                    f"request {i}: prompt of {n} tokens does not fit the context window "
                    f"(max_position_embeddings={cfg.max_position_embeddings}, needs < that)"
                )
            lo, hi = min(r.prompt_ids), max(r.prompt_ids)
            if lo < 0 or hi >= cfg.vocab_size:
                raise ValueError(
                    f"request {i}: prompt_ids must be in [0, {cfg.vocab_size}), got {lo}..{hi}"
                )
            drawn = int(torch.randint(0, 2**62, (1,), generator=gen))
            seeds.append(drawn if r.params.seed is None else int(r.params.seed))
        return seeds

    def _ensure_cache(self, slots: int, length: int) -> None:
        c = self.cache
        if c is not None and c.num_slots >= slots and c.max_len >= length:
            return
        if c is not None:
            slots, length = max(slots, c.num_slots), max(length, c.max_len)
        length = min(-(-length // 64) * 64, self.model.cfg.max_position_embeddings)
        self.cache = None  # free the old one first
        p = next(self.model.parameters())
        self.cache = KVCache(self.model.cfg, slots, length, dtype=p.dtype, device=p.device)
