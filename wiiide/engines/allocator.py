"""glibc's allocator under the torch engines: freed tensor memory goes back to the kernel, so that a
rank's RSS follows what it holds (`return_freed_memory`, `trim_heap`)."""

from __future__ import annotations

import ctypes
from typing import Any

# glibc's mallopt parameters (<malloc.h>): M_TRIM_THRESHOLD and M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Every allocation of at least this many bytes gets its own mmap and goes back to the kernel when freed.
MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_memory(libc: Any = None) -> dict[str, int] | None:
    """Make glibc give freed tensor memory back to the kernel, so that a rank's RSS follows what it holds.

    By default glibc's mmap threshold is dynamic (mallopt(3)): once a freed mmapped chunk (a 4 MB weight,
    a gathered FSDP unit) raises the threshold to its size, later buffers of that size come from the
    heap, and a heap page freed below a live one stays resident. FSDP allocates and frees a unit's
    gathered parameters and gradients at every forward and backward, so its RSS grew towards DDP's
    though it holds a fifth of the state (docs/workloads.md, "Memory under FSDP"). Setting ``M_MMAP_THRESHOLD`` fixes the
    threshold (and turns the dynamic adjustment off): every allocation of `MMAP_THRESHOLD_BYTES` or more
    is its own mapping, unmapped when freed; ``M_TRIM_THRESHOLD`` lets free() trim the heap's top above
    the same size. Both engines (ddp, fsdp) run with it, so they are compared under one allocator policy.
    Call it before the model is built. Cost: one mmap/munmap and fresh zero pages per large buffer.

    Args:
        libc: a loaded C library (tests); default ``ctypes.CDLL("libc.so.6")``.

    Returns:
        ``{"mmap_threshold_bytes": ..., "trim_threshold_bytes": ...}`` when glibc took both settings,
        None when there is no glibc (musl, macOS) or it refused.
    """
    try:
        libc = libc or ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and ok
    except (OSError, AttributeError):
        return None
    return {"mmap_threshold_bytes": MMAP_THRESHOLD_BYTES, "trim_threshold_bytes": MMAP_THRESHOLD_BYTES} if ok else None


def trim_heap() -> None:
    """``malloc_trim(0)`` (glibc): return the free pages inside the heap to the kernel (after the full
    model's build and sharding); nothing without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
