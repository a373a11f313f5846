"""DeepSpeed's ds_to_universal with its checkpoint reads memory-mapped.

ds_to_universal loads each source rank's optimizer file whole (torch.load) before cutting it
into per-parameter fragments, so each worker holds one rank's whole partition (fp32 weights and
both Adam moments, 12 bytes a parameter) and K workers K of them. Memory-mapped, the fragments
are read from the page cache as they are cut: a worker's own memory is the fragment it writes
(and, merging, one parameter's pieces); the file's pages are the kernel's to take back. The
output is byte for byte the same (benchmarks/reshard.py checks it).

    python -m dr_scale.checkpoint.universal_stream <ds_to_universal's arguments>

The workers are forked (ds_to_universal's ProcessPoolExecutor, Linux's default start method on
the Pythons we support) and so inherit the mapped load.
"""
import functools
import os
import runpy
import sys

import torch

_whole_load = torch.load


@functools.wraps(_whole_load)
def mapped_load(f, *args, **kwargs):
    if isinstance(f, (str, os.PathLike)) and "mmap" not in kwargs:
        try:
            return _whole_load(f, *args, mmap=True, **kwargs)
        except RuntimeError:  # a file in torch's legacy format cannot be mapped: read it whole
            pass
    return _whole_load(f, *args, **kwargs)


def load_for_conversion(f, *args, **kwargs):
    """mapped_load, a Muon run's optimizer state shown in Adam's keys (muon_state.py)."""
    from dr_scale.checkpoint.muon_state import adam_shaped

    return adam_shaped(mapped_load(f, *args, **kwargs), f)


if __name__ == "__main__":
    # The work is split over forked worker processes; a parent that has run torch's OpenMP
    # threads (load_for_conversion's Muon re-layout runs in it too) leaves its forked children
    # hanging in their first parallel op
    torch.set_num_threads(1)
    torch.load = load_for_conversion
    sys.argv[0] = "ds_to_universal"
    runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__", alter_sys=True)
