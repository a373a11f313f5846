"""Giving freed host memory back to the operating system (`train.release_host_memory`).

glibc's malloc serves tensors below its mmap threshold (which grows to 32 MiB as large blocks
are freed) from its heap and keeps their pages when they are freed, for reuse. On a CPU rank
those are most of a step's tensors: under ZeRO-3 with tensor parallelism the gathered 16-bit
slices (16 MiB each for llama_1b at TP 2) stay resident after DeepSpeed releases them, and the
optimizer step's fp32 gradient (made per sub-group in `_prepare_sub_group`) comes on top of
them. Measured with benchmarks/memory_scaling.py (llama_1b cut to 8 layers, ZeRO-3, bf16, 3
steps, 2-core EPYC, 2026-12-02), peak RSS per rank without / with a trim after each backward:
DP 2 x TP 2 4.31 / 3.54 GiB (0.82x), DP 2 6.45 / 5.92, DP 4 4.08 / 3.78, losses identical. The
steps after the first took 1.13x, 0.74x and 1.01x as long: within this machine's run-to-run
spread, but the pages are faulted in again at the next forward (a 5-step TP trace: 1.23x). So
it is a setting, off by default: for runs that must fit.

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
