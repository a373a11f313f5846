"""Sample indices built once and read entry by entry by every rank.

The arrays that turn a dataset into samples (the held-out split, the shuffled document order,
cumulative token counts, the blend of datasets, each epoch's sample permutation) grow with the
corpus: at 1T tokens, hundreds of millions of entries each. Built by every rank in its own RAM
they cost seconds and gigabytes per rank; here one process builds each once into
a folder keyed by everything it depends on, and every rank reads single entries from the files
as it needs them (FileArray: a read a lookup, no memory map, nothing kept).

    cache = IndexCache(folder)                 # folder None: arrays in memory (small data, tests)
    order = cache.get("train_order", build)    # a FileArray over the .npy once built

Built once per cluster: a missing array is built under the folder's file lock
(runtime/file_lock.py), so of all the ranks of all the nodes that share the folder, the first
builds and the others wait in the kernel, outside any collective and its timeout, then read it.
Files appear by atomic rename, so a reader never sees a half-written array. The key holds the
data files' content (size and a sampled hash), not their path or time: a dataset copied with its
`.index` folder (staged to node-local disk, say) finds its arrays there.
"""
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from dr_scale.errors import DrScaleError
from dr_scale.runtime import file_lock

VERSION = "3"  # bump when an array's meaning (or the key) changes


def key_of(*parts) -> str:
    h = hashlib.sha256(VERSION.encode())
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


SAMPLES, SAMPLE_BYTES = 32, 64 * 1024


def content_identity(path) -> tuple:
    """What a cache keyed on a file assumes unchanged: its size and the hash of 32 pieces of
    64 KiB spread evenly over it, first and last included (all of a file up to 2 MiB): ~2 MiB
    read whatever the file's size, the same for a copy anywhere. A change of the same size that
    misses every piece goes unseen: rewrite the file under a new name, or remove its .index."""
    size = Path(path).stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= SAMPLES * SAMPLE_BYTES:
            h.update(f.read())
        else:
            for i in range(SAMPLES):
                f.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
                h.update(f.read(SAMPLE_BYTES))
    return size, h.hexdigest()


class FileArray:
    """A 1-D array in a file, read with pread at each access.

    Why not a memory map: on this kernel (6.18, ext4) page-cache folios are large, and touching
    one element of a mapped file maps its whole folio into the process: 2,000 random samples of a
    1T-token dataset grew a rank's RSS by 6.4 GiB (1.7-6.7 MiB a lookup, madvise(MADV_RANDOM) or
    not). A read maps nothing, costs one system call (microseconds, against ~1 ms to assemble a
    sample), and is safe in forked data-loader workers (pread keeps no file offset)."""

    def __init__(self, path, dtype, offset: int, length: int):
        self.path, self.dtype = str(path), np.dtype(dtype)
        self.offset, self.length = int(offset), int(length)
        self._fd = os.open(self.path, os.O_RDONLY)

    @classmethod
    def of_npy(cls, path) -> "FileArray":
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(f)
            if len(shape) != 1:
                raise DrScaleError(f"{path}: expected a 1-D array, got shape {shape}")
            return cls(path, dtype, f.tell(), shape[0])

    def __len__(self):
        return self.length

    def read(self, start: int, count: int) -> np.ndarray:
        count = max(0, min(count, self.length - start))
        nbytes = count * self.dtype.itemsize
        raw = os.pread(self._fd, nbytes, self.offset + start * self.dtype.itemsize)
        if len(raw) != nbytes:
            raise DrScaleError(f"{self.path}: shorter than its header says (truncated?)")
        return np.frombuffer(raw, self.dtype, count)

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self.length)
            if step != 1:
                raise IndexError("FileArray slices take step 1")
            return self.read(start, stop - start)
        i = int(i)
        if i < 0:
            i += self.length
        if not 0 <= i < self.length:
            raise IndexError(f"index {i} out of range for {self.length} entries")
        return self.read(i, 1)[0]

    def __array__(self, dtype=None, copy=None):
        whole = self.read(0, self.length)
        return whole if dtype is None else whole.astype(dtype)

    def __getstate__(self):  # a data-loader worker reopens the file
        return {k: v for k, v in self.__dict__.items() if k != "_fd"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._fd = os.open(self.path, os.O_RDONLY)

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def smallest_int(max_value: int):
    return np.int32 if max_value < 2**31 else np.int64


class IndexCache:
    def __init__(self, folder: Optional[Path]):
        self.folder = None if folder is None else Path(folder)

    def get(self, name: str, make: Callable[[], np.ndarray]) -> np.ndarray:
        if self.folder is None:
            return make()
        path = self.folder / f"{name}.npy"
        if not path.is_file():
            with self._lock():
                if not path.is_file():  # nobody built it while this process waited
                    t0 = time.perf_counter()
                    tmp = path.with_name(f".{name}.{os.getpid()}.npy")
                    array = np.ascontiguousarray(make())
                    np.save(tmp, array)
                    os.replace(tmp, path)
                    print(f"dr_scale: index {self.folder.name}/{name}: {len(array):,} entries "
                          f"built in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                          flush=True)
        return FileArray.of_npy(path)

    def child(self, name: str) -> "IndexCache":
        return IndexCache(None if self.folder is None else self.folder / name)

    def stamp(self, name: str, check: Callable[[], None]):
        """Run `check` once per cache (e.g. a full validation of a large file), then remember."""
        if self.folder is None:
            check()
            return
        if (self.folder / name).is_file():
            return
        with self._lock():
            if not (self.folder / name).is_file():
                check()
                (self.folder / name).write_text("ok\n")

    def _lock(self):
        self.folder.mkdir(parents=True, exist_ok=True)
        return file_lock.exclusive(self.folder / ".lock",
                                   f"waiting for another process building {self.folder}")


def cache_folder(beside: Path, fallback_root: Path, name: str) -> Path:
    """`beside`/name if that folder can be written (next to the data), else under
    `fallback_root` (data.cache_dir): a read-only dataset still gets a cache."""
    preferred = Path(beside) / name
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        probe = preferred / f".probe{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return preferred
    except OSError:
        return Path(os.path.expanduser(fallback_root)) / "indices" / name
