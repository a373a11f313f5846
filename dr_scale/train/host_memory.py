"""Giving freed host memory back to the operating system (`train.release_host_memory`).

glibc's malloc serves tensors below its mmap threshold (which grows to 32 MiB as large blocks
are freed) from its heap and keeps their pages when they are freed, for reuse. On a CPU rank
those are most of a step's tensors: under ZeRO-3 with tensor parallelism the gathered 16-bit
slices (16 MiB each for llama_1b at TP 2) stay resident after DeepSpeed releases them, and the
optimizer step's fp32 gradient (made per sub-group in `_prepare_sub_group`) comes on top of
them. Measured (llama_1b cut to 8 layers, ZeRO-3, DP 2 x TP 2, bf16, 2-core EPYC): peak RSS per
rank 4.18-4.47 GiB, 3.38-3.47 GiB with a trim after each backward, losses identical; the steps
took ~1.2x as long, since the next forward faults the pages in again. So it is a setting, off
by default: for runs that must fit, not for throughput.

malloc_trim(0) (glibc >= 2.8) returns every whole free page of every arena, not only the top of
the heap. Elsewhere (musl, macOS) there is nothing to call and the setting does nothing, which
the start line says.
"""
import ctypes
import ctypes.util
import functools
from typing import Optional


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def can_release() -> bool:
    return _malloc_trim() is not None


def release_freed() -> Optional[bool]:
    """Return the allocator's free pages to the OS: True if some were, False if none were,
    None where the C library cannot (not glibc)."""
    trim = _malloc_trim()
    return None if trim is None else bool(trim(0))
