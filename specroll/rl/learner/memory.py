"""Process memory of the learner on the CPU: keep freed memory for reuse."""

from __future__ import annotations

_KEEP_FREED = False


def keep_freed_memory(limit: int = 1 << 30) -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the kernel.

    glibc serves each allocation above its mmap threshold (dynamic, a few MiB) with a
    fresh mapping and unmaps it on free, so every micro-batch's activations, logits and
    gradients (10 MB to 1 GB each) are page-faulted in and zeroed by the kernel again: a
    large share of stage `train` on a CPU (docs/performance_notes.md). Here blocks below
    `limit` come from the heap and freed memory stays in it (the heap is never trimmed):
    the process keeps its peak. Process-wide (the engine in the same process benefits
    too), idempotent; a no-op without glibc. Returns whether it applies."""
    global _KEEP_FREED
    if _KEEP_FREED:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has no mallopt knobs)
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        ok = libc.mallopt(m_mmap_threshold, ctypes.c_int(min(limit, 2**31 - 1))) == 1
        ok = ok and libc.mallopt(m_trim_threshold, ctypes.c_int(-1)) == 1  # never trim
    except (OSError, AttributeError):
        return False
    _KEEP_FREED = ok
    return ok
