"""An exclusive lock on a file, for work done once on shared storage (the data's sample index,
the bundled corpus): the first process to take it builds, the others wait and then read.

Why not the `filelock` package (installed with torch): its acquire retries a non-blocking lock
every 50 ms, so a thousand ranks waiting on a shared file system ask the server twenty times a
second each. A blocking flock waits in the kernel (over NFS the lock manager grants it; Lustre
needs its `flock` mount option, without which the lock fails at once: said in one line). Waiting
here is outside any collective, so no collective timeout bounds a long build.
"""
import contextlib
import errno
import fcntl
import os
import sys
from pathlib import Path

from dr_scale.errors import DrScaleError
from dr_scale.runtime.ranks import local_rank


@contextlib.contextmanager
def exclusive(path, waiting_note: str = ""):
    """Hold an exclusive lock on `path` (created if missing) for the block. `waiting_note`:
    printed once, by a node's local rank 0, when another process holds the lock."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                _refuse(path, e)
            if waiting_note and local_rank() == 0:
                print(f"dr_scale: {waiting_note}", file=sys.stderr, flush=True)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as e:
                _refuse(path, e)
        yield
    finally:
        os.close(fd)  # releases the lock


def _refuse(path: Path, e: OSError):
    raise DrScaleError(f"{path}: cannot take a file lock ({e.strerror}); the file system must "
                       f"support flock (Lustre: mount with -o flock), or set data.cache_dir to "
                       f"one that does") from None
