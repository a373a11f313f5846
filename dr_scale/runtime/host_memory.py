"""What glibc's malloc does with freed host memory on a CPU rank: kept for the next step's
tensors (the default), or given back to the operating system (`train.release_host_memory`).

Kept, the default on CPU ranks: glibc maps every block above its mmap threshold (at most 32 MiB)
on its own and unmaps it when freed, and trims the heap's free top, so a step's large tensors
(llama_125m at 8 x 256 tokens: the 2,048 x 32,000 logits, their fp32 copy and gradients, the
flat gradient buffers) are new pages every step, each faulted in and zeroed by the kernel again:
about 0.4 s a GiB on this project's AMX Xeon, measured. With no block mapped on its own
(mallopt M_MMAP_MAX 0) and no trim below 2 GiB of free top (M_TRIM_THRESHOLD), freed blocks stay
in the heap and later tensors reuse them, as torch's caching allocator does on a GPU: 1.12-1.33x
the tokens/s for llama_125m on 2 CPU ranks, for up to 1.56x the estimated resident memory
(docs/performance.md, "Host memory on CPU ranks"); `train.release_host_memory=true` for runs that
must fit. Why not jemalloc or tcmalloc (the usual advice for CPU training): they must be preloaded
into each rank before it starts (LD_PRELOAD), which DeepSpeed's launcher does not do, and jemalloc
5.3's defaults unmap blocks above 8 MiB at once as glibc does (64 MiB tensors made again fault
every time, measured); glibc's own settings are reachable from inside the run.

Released (`train.release_host_memory`):

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
the heap. The trim comes after the backward, so the setting also fixes the mmap threshold at
MMAP_THRESHOLD_BYTES before the model is built (mallopt; glibc then stops raising it): larger
tensors get pages of their own, given back the moment they are freed, at start-up (the build's
whole fp32 tensors) and in the step (the flattened fp32 gradient) alike. Measured with a
per-phase probe (llama_1b cut to 8 layers, ZeRO-3, fp32, 2 ranks, AVX2-only EPYC, 2026-12-03,
threshold as an environment variable): RSS after the build 1.63 -> 1.20 GiB, between steps
6.41 -> 5.81, peak 8.36 -> 8.04. Elsewhere (musl, macOS) there is nothing to call and the setting
does nothing, which the start line says.
"""
import ctypes
import ctypes.util
import functools
from typing import Optional


# Tensors from this size up are mmapped and unmapped when freed: 4 MiB, above a micro-batch's
# activation rows at the sizes CPU ranks train (2 MiB for 256 tokens x 2048 x fp32), below the
# weights and partitions ZeRO-3 gathers and frees every step.
MMAP_THRESHOLD_BYTES = 4 * 2**20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc's malloc.h
KEEP_FREE_TOP_BYTES = 2 ** 31 - 1  # mallopt takes an int: the most it can be told


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    return getattr(_libc(), "malloc_trim", None)  # glibc's alone


def give_large_blocks_pages_of_their_own() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES (see the module's docstring); False
    where the C library is not glibc."""
    if _malloc_trim() is None:
        return False
    return bool(_libc().mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def settle(release: bool, device_type: str) -> Optional[str]:
    """Apply the run's choice before the build's tensors are made: freed memory handed back
    (`train.release_host_memory`), or kept on a CPU rank; its start line, or None where glibc's
    defaults stand unremarked (a GPU rank that did not ask)."""
    if not release and device_type != "cpu":
        return None
    if not can_release():
        return ("train.release_host_memory does nothing here: " if release else "") + \
            "the C library is not glibc, its allocator's defaults kept"
    if release:
        give_large_blocks_pages_of_their_own()
        return ("freed host memory returned to the OS after each backward, tensors from "
                f"{MMAP_THRESHOLD_BYTES // 2**20} MiB up in pages of their own")
    keep_freed_blocks_for_reuse()
    return ("freed blocks kept for the next step's tensors (glibc: none mapped on its own, the "
            "heap's top not trimmed; train.release_host_memory=true returns them)")


def keep_freed_blocks_for_reuse() -> bool:
    """No block mapped on its own, the heap's free top kept (see the module's docstring); False
    where the C library is not glibc."""
    if _malloc_trim() is None:
        return False
    libc = _libc()
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and \
        bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREE_TOP_BYTES))


def can_release() -> bool:
    return _malloc_trim() is not None


def release_freed() -> Optional[bool]:
    """Return the allocator's free pages to the OS: True if some were, False if none were,
    None where the C library cannot (not glibc)."""
    trim = _malloc_trim()
    return None if trim is None else bool(trim(0))
