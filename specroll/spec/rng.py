"""Counter-based float64 uniforms: one independent stream per (seed, stream, counter).

A request's randomness is a pure function of its own seed and of how many tokens it has
produced, never of the batch it happens to share: the same request gives the same
tokens alone or among 31 others, in any order (batch-permutation invariance), and a
drafter can be given its own stream without ever seeing the verifier's draws.

The hash is splitmix64 (Steele et al. 2014) on int64 tensors; its output passes BigCrush
as a finaliser, which is what the statistical tests rely on.

Seeds are integers in [0, 2**62) (`SEED_LIMIT`), and a stream's key is
`seed * NUM_STREAMS + stream`, i.e. the 64-bit word `seed << 2 | stream`. On that domain
(seed, stream) -> key is injective (62 + 2 bits fit one word without wrapping), and `mix64`
is a bijection of 64-bit words (an added constant, xor-shifts and multiplications by odd
constants are each invertible), so distinct (seed, stream) pairs always get distinct
stream bases `mix64(key)`: no two seeds share a stream. A larger range cannot have that
property: 3 streams x 2**63 seeds > 2**64 keys. (Two different bases could still produce
overlapping counter sequences if they landed within one generation length of each other;
for bases that look uniformly random that is a ~2**-40 event per pair of requests.)
"""

from __future__ import annotations

import operator

import torch

# splitmix64 constants as signed int64 (two's complement of the unsigned values)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MUL1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MUL2 = -7723592293110705685  # 0x94D049BB133111EB

SEED_LIMIT = 1 << 62
"""Seeds are integers in [0, SEED_LIMIT); see the module docstring for why 2**62."""
NUM_STREAMS = 4
"""Stream slots per seed (2 bits of the key); the named streams below use 0..2."""

# named streams so callers cannot collide by accident
SAMPLE = 0
"""Target-token sampling (plain decoding, bonus and recovered tokens)."""
ACCEPT = 1
"""Acceptance tests of the verifier."""
DRAFT = 2
"""Draft sampling (drafters only)."""


def check_seed(seed: object) -> int:
    """`seed` as an int if it is an integer in [0, SEED_LIMIT), else ValueError.

    Enforced where seeds enter (SamplingParams): outside the range the key derivation
    would wrap (seed s and s + 2**62 would draw identical tokens) or overflow int64.
    """
    try:
        value = operator.index(seed)  # ints and integer numpy scalars, not floats / bools
    except TypeError:
        value = None
    if value is None or isinstance(seed, bool) or not 0 <= value < SEED_LIMIT:
        raise ValueError(f"seed must be an integer in [0, 2**62) or None, got {seed!r}")
    return value


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on an int64 tensor (wrapping arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def uniforms(seed: torch.Tensor, counter: torch.Tensor, stream: int = SAMPLE) -> torch.Tensor:
    """Float64 uniforms in [0, 1), one per element.

    seed: [B] int64 per-request seeds in [0, SEED_LIMIT) (validated where they enter, see
    `check_seed`); counter: [B] or [B, n] int64 (e.g. the index of the generated token);
    stream: which independent stream (SAMPLE / ACCEPT / DRAFT / ...), in [0, NUM_STREAMS).
    """
    if not 0 <= stream < NUM_STREAMS:
        raise ValueError(f"stream must be in [0, {NUM_STREAMS}), got {stream}")
    if counter.dim() == seed.dim() + 1:
        seed = seed.unsqueeze(-1)
    key = seed * NUM_STREAMS + stream  # injective for seed < 2**62 (no wrap), see module doc
    h = mix64(mix64(key) + counter)
    return _shr(h, 11).to(torch.float64) * (1.0 / (1 << 53))
