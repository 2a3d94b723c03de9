"""What goes into the engine and what comes out of it, and the checks and seeds every
rollout backend applies to a batch of requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specroll.spec.metrics import SpecStats
from specroll.spec.rng import SEED_LIMIT, check_seed


@dataclass
class SamplingParams:
    """Per-request sampling settings, validated on construction."""

    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off."""
    top_p: float = 1.0
    """Keep the smallest set of tokens with this much mass; 1 = off. In (0, 1]."""
    max_new_tokens: int = 128
    """Generation budget in tokens (>= 1)."""
    stop_token_ids: tuple[int, ...] | None = None
    """Ids that end the request (included in the output); None = the model's EOS ids."""
    seed: int | None = None
    """Per-request seed, an integer in [0, 2**62); None = drawn from the engine's seed in
    submission order. Distinct seeds never share a random stream (see spec.rng)."""
    max_draft: int | None = None
    """Most draft tokens per speculative iteration for this request (0 = never speculate);
    None = whatever the engine's depth policy chooses."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_draft is not None and self.max_draft < 0:
            raise ValueError(f"max_draft must be >= 0 or None, got {self.max_draft}")
        if self.seed is not None:
            self.seed = check_seed(self.seed)
        if self.stop_token_ids is not None:
            self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    def stops(self, eos: Sequence[int]) -> tuple[int, ...]:
        """The ids that end the request: `stop_token_ids`, or else `eos` (the model's)."""
        return tuple(eos) if self.stop_token_ids is None else self.stop_token_ids


@dataclass
class Request:
    """A prompt (token ids) and how to continue it."""

    prompt_ids: list[int]
    """Prompt token ids (chat template already applied)."""
    params: SamplingParams = field(default_factory=SamplingParams)
    """Sampling settings."""
    request_id: str | int | None = None
    """Caller's id, echoed in the result; None = position in the submitted list."""


@dataclass
class Result:
    """A finished request."""

    request_id: str | int
    prompt_ids: list[int]
    token_ids: list[int]
    """Generated ids, including the stop token when finish_reason is 'stop'."""
    logprobs: list[float]
    """Log-prob of each generated token under the processed distribution it was drawn
    from: log_softmax(logits / T) (T = 1 if greedy), truncated to the top-k / top-p set
    and renormalised when those are on."""
    finish_reason: str
    """'stop' (a stop token), 'length' (max_new_tokens) or 'context' (context window full)."""
    seed: int
    """The seed the request ran with (reproduces it exactly)."""
    first_token_s: float
    """Seconds from the start of generate() to this request's first token."""
    latency_s: float
    """Seconds from the start of generate() to this request's last token."""
    policy_version: int = 0
    """Version of the policy weights that generated this result (`Engine.load_weights`)."""
    draft_version: int | None = None
    """Version of the draft weights used (None = no drafter)."""
    spec: SpecStats = field(default_factory=SpecStats)
    """This request's speculation counters: drafts, draft/accepted tokens, acceptance
    length and rate, per-position acceptance (timing and forwards are batch-level)."""


class Results(list):
    """What `Engine.generate` returns: the Results in request order (a list), and the
    call's batch-level speculation metrics in `stats` (acceptance, forwards, time split)."""

    def __init__(self, results: list[Result] = (), stats: SpecStats | None = None) -> None:
        super().__init__(results)
        self.stats = stats if stats is not None else SpecStats()


def check_prompts(requests: Sequence[Request], context_len: int, vocab_size: int) -> None:
    """ValueError naming the first request whose prompt is empty, does not leave room for
    a token in the context window (`context_len` positions) or holds an id outside
    [0, vocab_size)."""
    for i, r in enumerate(requests):
        n = len(r.prompt_ids)
        if n == 0:
            raise ValueError(f"request {i}: prompt_ids is empty")
        if n >= context_len:
            raise ValueError(
                f"request {i}: prompt of {n} tokens does not fit the context window "
                f"(max_position_embeddings={context_len}, needs < that)"
            )
        lo, hi = min(r.prompt_ids), max(r.prompt_ids)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(
                f"request {i}: prompt_ids must be in [0, {vocab_size}), got {lo}..{hi}"
            )


def request_seeds(requests: Sequence[Request], seed: int) -> list[int]:
    """Each request's seed: its own, or else one drawn in [0, SEED_LIMIT) from a CPU
    generator seeded with `seed`. One draw per request, whether used or not, so a
    request's drawn seed depends only on its position in the batch; drawn on the host,
    so the seeds are the same whatever device generates."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seeds = []
    for r in requests:
        drawn = int(torch.randint(0, SEED_LIMIT, (1,), generator=gen, device="cpu"))
        seeds.append(drawn if r.params.seed is None else int(r.params.seed))
    return seeds
