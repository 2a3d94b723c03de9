"""Counter-based float64 uniforms: one independent stream per (seed, stream, counter).

A request's randomness is a pure function of its own seed and of how many tokens it has
produced, never of the batch it happens to share: the same request gives the same
tokens alone or among 31 others, in any order (batch-permutation invariance), and a
drafter can be given its own stream without ever seeing the verifier's draws.

The hash is splitmix64 (Steele et al. 2014) on int64 tensors; its output passes BigCrush
as a finaliser, which is what the statistical tests rely on.
"""

from __future__ import annotations

import torch

# splitmix64 constants as signed int64 (two's complement of the unsigned values)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MUL1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MUL2 = -7723592293110705685  # 0x94D049BB133111EB

# named streams so callers cannot collide by accident
SAMPLE = 0
"""Target-token sampling (plain decoding, bonus and recovered tokens)."""
ACCEPT = 1
"""Acceptance tests of the verifier."""
DRAFT = 2
"""Draft sampling (drafters only)."""


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

    seed: [B] int64 per-request seeds; counter: [B] or [B, n] int64 (e.g. the index of the
    generated token); stream: which independent stream (SAMPLE / ACCEPT / DRAFT / ...).
    """
    if counter.dim() == seed.dim() + 1:
        seed = seed.unsqueeze(-1)
    h = mix64(mix64(seed * 4 + stream) + counter)
    return _shr(h, 11).to(torch.float64) * (1.0 / (1 << 53))
