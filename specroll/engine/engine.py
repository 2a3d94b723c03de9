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

What one forward does to the slots (the prefill of admitted rows, the decode/verify step,
the recording of verified tokens) is `engine.iteration`'s `Stepper`, the base of `Engine`;
this module admits, completes and compacts requests around it.

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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specroll.drafters.base import Drafter
from specroll.engine import graphs
from specroll.engine.depth import DepthPolicy, FixedDepth
from specroll.engine.forms import FORMS
from specroll.engine.graphs import Graphs
from specroll.engine.heap import young_heap_only
from specroll.engine.iteration import Stepper
from specroll.engine.prompt_reuse import PromptReuse
from specroll.engine.request import Request, Result, Results, check_prompts, request_seeds
from specroll.engine.slots import Slots
from specroll.model.kv_cache import KVCache
from specroll.model.transformer import Transformer
from specroll.model.weights import load_state
from specroll.spec.metrics import CollapseDetector, SpecStats


@dataclass
class EngineConfig:
    """Rollout engine settings."""

    max_batch: int = 32
    """Cache slots: the most requests decoded together."""
    seed: int = 0
    """Seeds requests that carry none (in submission order)."""
    cuda_graphs: bool = False
    """On a CUDA device, replay each decoding iteration's device step as a CUDA graph
    captured per (batch bucket, depth) (`engine.graphs`); ignored elsewhere. Off until
    measured better on a GPU (benchmarks/gpu_check.py)."""

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")


class Engine(Stepper):
    """Generates completions for batches of requests with one policy model.

    With a `drafter`, decoding is speculative with the depth chosen per iteration by
    `depth` (default: k = 3 at every batch size); `stats` holds the last call's metrics.
    """

    def __init__(
        self,
        model: Transformer,
        config: EngineConfig | None = None,
        drafter: Drafter | None = None,
        depth: DepthPolicy | None = None,
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
        self.forms = tuple(getattr(drafter, "forms", ()))
        """The proposal forms the depth policy chooses between (`engine.forms`)."""
        if not set(self.forms) <= set(FORMS):
            raise ValueError(f"drafter forms must be among {FORMS}, got {self.forms}")
        self.stats = SpecStats()
        self.captured: Graphs | None = None
        """The captured decoding steps (`engine.graphs`), kept while the slots are."""
        self._st: Slots | None = None
        self._collapse = CollapseDetector()
        self.policy_version = 0
        """Version of the policy weights (set by `load_weights`; reported in every Result)."""

    # ------------------------------------------------------------------ public API

    def load_weights(
        self,
        version: int,
        policy: dict[str, torch.Tensor],
        draft: dict[str, torch.Tensor] | None = None,
        partial: bool = False,
    ) -> None:
        """New weights (tensors by name) under `version`, which every later Result
        carries as its policy (and draft) version; then prepacked (`warm`).

        They are copied into the engine's own tensors in place: names and shapes must be
        the engine's (ValueError names the first that differs). `draft` goes into the
        drafter's network; None keeps the draft weights as they are. partial: `policy`
        names some of the model's tensors (a LoRA refit, `model.lora.Served`)."""
        load_state(self.model, policy, "policy", partial)
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
        st = self._slots(n_slots, max_gen, max(len(s) for s in stops))
        if self.drafter is not None:
            self.drafter.start(self.cache.num_slots, self.cache.max_len, st.host)
            self.depth.forms.restart()  # the time between calls is not an iteration
        self.stats = SpecStats()
        self.reuse = PromptReuse.for_cache(self.cache)  # (the weights are fixed until we return)
        versions = (self.policy_version, None if self.drafter is None else self.drafter.version)
        on = self.config.cuda_graphs and self.device.type in graphs.CAPTURE_ON
        # the one place captured steps end: they hold the slots', the cache's and (off
        # CUDA, where new weights are packed anew: `model.packed`) the weights' tensors
        held = (st, self.cache, None if self.device.type == "cuda" else versions)
        if not on or self.captured is None or not self.captured.holds(*held):
            self.captured = Graphs(self.device, *held) if on else None
        capture_s = 0.0 if self.captured is None else self.captured.capture_s

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
                done = st.host.finished(B)
                for b in sorted(done, reverse=True):
                    j = st.host.request[b]
                    results[j] = st.result(b, requests[j], seeds[j], done[b], versions)
                    results[j].first_token_s = first_token[j]
                    results[j].latency_s = time.perf_counter() - t0
                    B = self._free(st, b, B, len(results[j].token_ids))
                if on_progress is not None:
                    on_progress(stepped, len(done))
        self.stats.total_s = time.perf_counter() - t0
        self.stats.prompts_reused = self.reuse.reused
        if self.captured is not None:
            self.stats.graphs = len(self.captured)
            self.stats.capture_s = self.captured.capture_s - capture_s
            self.stats.graph_bytes = self.captured.pool_bytes
            self.stats.graph_failures = len(self.captured.failed)
        return Results(results, self.stats)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ bookkeeping

    def _free(self, st: Slots, b: int, B: int, generated: int) -> int:
        """Slot b of B active ones finished with `generated` tokens kept: the last active
        row takes its place (compaction) → the rows still active."""
        if self.drafter is not None:
            self.drafter.release(b, generated)
        B -= 1
        if b != B:
            self.cache.move(B, b, st.host.pos[B])
            st.move(B, b)  # (the host's rows first: a drafter's move reads them)
            if self.drafter is not None:
                self.drafter.move(B, b)
        return B

    def _slots(self, n: int, max_gen: int, max_stops: int) -> Slots:
        """Slots for a call: the last call's when they hold it (n rows, max_gen tokens,
        max_stops stop ids, this cache), so that graphs captured over them stay valid
        from call to call (an RL run's calls are alike); else new ones (which no capture
        holds: `Graphs.holds`)."""
        st = self._st
        if not (
            st is not None
            and len(st.pos) >= n
            and st.tokens.shape[1] >= max_gen + st.k_max + 1
            and st.stops.shape[1] >= max_stops
            and st.max_len == self.cache.max_len
            and st.k_max == self.depth.k_max
        ):
            self._st = None
            self._st = Slots(
                n, max_gen, max_stops, self.cache.max_len, self.depth.k_max, self.device
            )
        return self._st

    def _ensure_cache(self, slots: int, length: int) -> None:
        c = self.cache
        if c is not None and c.num_slots >= slots and c.max_len >= length:
            return
        self._st = self.captured = None  # (memory: they hold the old cache's tensors)
        if c is not None:
            slots, length = max(slots, c.num_slots), max(length, c.max_len)
        length = min(-(-length // 64) * 64, self.model.cfg.max_position_embeddings)
        self.cache = None  # free the old one first
        dtype = next(self.model.parameters()).dtype
        self.cache = KVCache(self.model.cfg, slots, length, dtype=dtype, device=self.device)
