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
DCP's pinned-memory staging does; train.async_snapshot=false copies nothing. The first snapshot's
buffers are mapped ahead in a thread (`SnapshotBuffers.prepare`, sized by a rehearsal of the save
that writes nothing: writer.py). Fresh CPU buffers come from one anonymous mapping
whose pages are mapped in a few calls, not one fault at a time (MAP_POPULATE on the loop: 0.3-1.9
s a GiB on this project's virtual machines, against 1.8-2.7 s faulting them one by one, as fast
as the host has backed those pages before); torch's allocator has no such switch.
"""
import ctypes
import mmap
import threading
from typing import Any, Optional

import torch

_ALIGN = 64  # bytes: each buffer cut from a mapping starts on a cache line


def populated_buffers(sizes, background: bool = False) -> list:
    """CPU byte storages of `sizes`, cut from one anonymous mapping whose pages are mapped at once.
    Each storage keeps the mapping alive and has its own size, so torch.save writes its bytes
    only. `background`: mapped 64 MiB at a time (madvise MADV_POPULATE_WRITE, else zeroed), not
    in one MAP_POPULATE call, which holds the process's memory-map lock for seconds and so stalls
    the training thread's own allocations (measured: a matmul loop beside it ran at 0.55-1.1 of
    its 1.8 a second; 1.2-1.4 beside the chunked mapping)."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    if total == 0:
        return [torch.empty(0, dtype=torch.uint8).untyped_storage() for _ in sizes]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    mapping = mmap.mmap(-1, total, flags=flags if background else
                        flags | getattr(mmap, "MAP_POPULATE", 0))
    if background:
        _populate_in_chunks(mapping, total)
    return [torch.frombuffer(mapping, dtype=torch.uint8, count=size, offset=offset)
            .untyped_storage() if size else torch.empty(0, dtype=torch.uint8).untyped_storage()
            for size, offset in zip(sizes, offsets)]


_MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python's mmap module may not name it
_CHUNK = 64 * 2**20


def _populate_in_chunks(mapping: mmap.mmap, total: int):
    libc = ctypes.CDLL(None, use_errno=True)  # ctypes calls leave the GIL to the training thread
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    advise = True
    for offset in range(0, total, _CHUNK):
        length = min(_CHUNK, total - offset)
        if advise and libc.madvise(address + offset, length, _MADV_POPULATE_WRITE) == 0:
            continue
        advise = False  # an older kernel: touch the pages by writing them
        ctypes.memset(address + offset, 0, length)


class SnapshotBuffers:
    """Host buffers of the last snapshot, reused by the next one of the same storage sizes (a
    run's state dicts have the same structure at every save). `prepare` maps the first
    snapshot's buffers ahead, in a thread, so that snapshot only copies."""

    def __init__(self):
        self._kept: dict = {}  # (bytes, pinned) -> storages of the last snapshot
        self._preparing: Optional[threading.Thread] = None

    def prepare(self, obj: Any, clone_cpu: bool = True):
        """Map, in a background thread, the buffers a snapshot of `obj` will need: the page
        faults of fresh memory (seconds a GiB on virtual machines) are then paid off the
        training loop's time."""
        sizes = [_size_key(s) for s in _storages_to_copy(obj, clone_cpu)]

        def allocate():
            cpu = [nbytes for nbytes, pinned in sizes if not pinned]
            for host in populated_buffers(cpu, background=True):
                self.keep((host.nbytes(), False), host)
            for nbytes, pinned in sizes:
                if pinned:
                    self.keep((nbytes, True), torch.empty(nbytes, dtype=torch.uint8,
                                                          pin_memory=True).untyped_storage())
        self._preparing = threading.Thread(target=allocate, name="dr_scale snapshot buffers",
                                           daemon=True)
        self._preparing.start()

    def reuse(self) -> dict:
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None
        kept, self._kept = self._kept, {}
        return kept

    def keep(self, key, storage):
        self._kept.setdefault(key, []).append(storage)


def _size_key(storage: torch.UntypedStorage) -> tuple:
    """(bytes, pinned): which kept buffers fit a copy of `storage`."""
    return storage.nbytes(), storage.device.type != "cpu" and torch.cuda.is_available()


def _storages_to_copy(obj: Any, clone_cpu: bool) -> list:
    """The distinct storages of the tensors in `obj` a snapshot copies."""
    unique: dict = {}

    def add(t: torch.Tensor):
        storage = t.untyped_storage()
        if clone_cpu or storage.device.type != "cpu":
            unique.setdefault((storage.device, storage.data_ptr(), storage.nbytes()), storage)
    _visit(obj, add)
    return list(unique.values())


def host_snapshot(obj: Any, clone_cpu: bool = True,
                  buffers: Optional[SnapshotBuffers] = None) -> Any:
    """`obj` (state dicts: dicts, lists, tuples of tensors and plain values) with every tensor's
    storage in host memory: GPU storages copied; CPU storages copied too when `clone_cpu`
    (an asynchronous write), shared otherwise (a synchronous one only needs them on the host).
    `buffers`: where the copies' memory comes from and is kept for the next snapshot."""
    copies: dict = {}  # an original storage -> its copy
    reusable = buffers.reuse() if buffers is not None else {}

    # the storages no kept buffer fits get buffers mapped in one call
    available = {size: len(free) for size, free in reusable.items()}
    fresh_sizes = []
    for storage in _storages_to_copy(obj, clone_cpu):
        size = _size_key(storage)
        if available.get(size, 0):
            available[size] -= 1
        elif not size[1]:
            fresh_sizes.append(size[0])
    fresh: dict = {}
    for host in populated_buffers(fresh_sizes):
        fresh.setdefault((host.nbytes(), False), []).append(host)
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
        size = _size_key(storage)
        free = reusable.get(size) or fresh.get(size)
        host = free.pop() if free else torch.empty(storage.nbytes(), dtype=torch.uint8,
                                                   pin_memory=size[1]).untyped_storage()
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


def _visit(x, on_tensor):
    """Call `on_tensor` on every tensor but meta ones in the containers host_snapshot copies."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "meta":
            on_tensor(x)
    elif isinstance(x, dict):
        for v in x.values():
            _visit(v, on_tensor)
    elif isinstance(x, list) or type(x) is tuple:
        for v in x:
            _visit(v, on_tensor)
