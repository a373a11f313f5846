"""A checkpoint's state copied to host memory, so the files can be written from the copy while
training changes the originals (train.async_save with train.async_snapshot).

The copy is of storages, not tensors: tensors that share a storage (views of one flat buffer,
as DeepSpeed's state dicts hold) share it in the copy too, so torch.save writes the same bytes
from the copy as from the originals, and nothing is copied twice. GPU storages go to pinned host
memory with non-blocking copies and one synchronisation at the end.

The copies' buffers are kept for the next save (`SnapshotBuffers`): a fresh buffer costs a page
fault per page at first touch, which made a first snapshot on CPU ranks run at 0.6 GB/s against
several GB/s into pages already mapped (and pinning memory costs more than copying into it). So an
asynchronous save holds one checkpoint's worth of host memory per rank for the run, as torch
DCP's pinned-memory staging does; train.async_snapshot=false copies nothing.
"""
from typing import Any, Optional

import torch


class SnapshotBuffers:
    """Host buffers of the last snapshot, reused by the next one of the same storage sizes (a
    run's state dicts have the same structure at every save)."""

    def __init__(self):
        self._kept: dict = {}  # (bytes, pinned) -> storages of the last snapshot

    def reuse(self) -> dict:
        kept, self._kept = self._kept, {}
        return kept

    def keep(self, key, storage):
        self._kept.setdefault(key, []).append(storage)


def host_snapshot(obj: Any, clone_cpu: bool = True,
                  buffers: Optional[SnapshotBuffers] = None) -> Any:
    """`obj` (state dicts: dicts, lists, tuples of tensors and plain values) with every tensor's
    storage in host memory: GPU storages copied; CPU storages copied too when `clone_cpu`
    (an asynchronous write), shared otherwise (a synchronous one only needs them on the host).
    `buffers`: where the copies' memory comes from and is kept for the next snapshot."""
    copies: dict = {}  # an original storage -> its copy
    reusable = buffers.reuse() if buffers is not None else {}
    pending_cuda = False

    def storage_copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
        nonlocal pending_cuda
        key = (storage.device, storage.data_ptr(), storage.nbytes())
        if key in copies:
            return copies[key]
        on_cpu = storage.device.type == "cpu"
        if on_cpu and not clone_cpu:
            copies[key] = storage
            return storage
        pinned = not on_cpu and torch.cuda.is_available()
        size = (storage.nbytes(), pinned)
        free = reusable.get(size)
        host = free.pop() if free else torch.empty(storage.nbytes(), dtype=torch.uint8,
                                                   pin_memory=pinned).untyped_storage()
        # a tensor copy, not storage.copy_: torch spreads a large CPU copy over its threads
        target = torch.empty(0, dtype=torch.uint8).set_(host)
        target.copy_(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage),
                     non_blocking=not on_cpu)
        pending_cuda = pending_cuda or not on_cpu
        if buffers is not None:
            buffers.keep(size, host)
        copies[key] = host
        return host

    def copy(x):
        if isinstance(x, torch.Tensor):
            if x.device.type == "meta":
                return x
            storage = storage_copy(x.untyped_storage())
            return torch.empty(0, dtype=x.dtype).set_(storage, x.storage_offset(), x.size(),
                                                      x.stride())
        if isinstance(x, dict):  # OrderedDict too
            return type(x)((k, copy(v)) for k, v in x.items())
        if isinstance(x, list):
            return [copy(v) for v in x]
        if type(x) is tuple:  # torch.Size and named tuples hold no tensors here: kept as are
            return tuple(copy(v) for v in x)
        return x  # numbers, strings, None, enums: immutable

    out = copy(obj)
    if pending_cuda:
        torch.cuda.synchronize()
    return out
