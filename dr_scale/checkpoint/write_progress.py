"""The confirmation of a checkpoint waits for the slowest rank as long as its writes progress.

Every rank reports, while it writes, fsyncs and checksums its files, a counter of the work done
(bytes in its files so far, plus files fsynced and read back) to the job's key-value store, and
marks itself done. The ranks then meet in the confirmation's collective only once all are done,
so a rank whose shared file system is ten minutes slower does not run a collective into its
timeout; a rank whose counter has not moved for `stall_s` (dead, or stuck in the kernel) ends
the save in one line naming it. Waiting is the store's own blocking wait, in slices of
`interval_s`: no polling of the file system, one store request per slice per rank.
"""
import datetime
import os
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

import torch.distributed as dist

from dr_scale.errors import DrScaleError


class WriteProgress:
    """This rank's side: `with WriteProgress(store, rank, files): ...` reports until done."""

    def __init__(self, store, rank: int, files: Iterable, interval_s: float = 5.0):
        self.store, self.rank, self.interval_s = store, rank, interval_s
        self.files = [Path(f) for f in files]
        self.units = 0  # files fsynced and read back: progress their sizes do not show
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def advance(self, n: int = 1):
        self.units += n

    def done_so_far(self) -> int:
        written = 0
        for f in self.files:
            try:
                written += os.stat(f).st_size
            except OSError:  # not created yet
                pass
        return written + self.units

    def _report(self):
        self.store.set(f"progress/{self.rank}", str(self.done_so_far()))

    def __enter__(self):
        if self.store is not None:
            self._report()

            def loop():
                while not self._stop.wait(self.interval_s):
                    self._report()
            self._thread = threading.Thread(target=loop, name="dr_scale write progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._report()
            self.store.set(f"done/{self.rank}", "1")  # also after a failure: it is confirmed
        return False


def wait_for_writers(store, world: int, what: str, stall_s: float, interval_s: float = 5.0):
    """Block until every rank is done; raise one line naming a rank whose progress stopped for
    `stall_s` seconds."""
    done = [f"done/{r}" for r in range(world)]
    last = {}  # rank -> (counter, when it last changed)
    while True:
        try:
            store.wait(done, datetime.timedelta(seconds=interval_s))
            return
        except (dist.DistStoreError, RuntimeError):  # the slice ran out: who is still writing
            pass
        now = time.monotonic()
        for r in range(world):
            if store.check([f"done/{r}"]):
                continue
            counter = store.get(f"progress/{r}").decode() if store.check([f"progress/{r}"]) \
                else "0"
            if r not in last or last[r][0] != counter:
                last[r] = (counter, now)
            elif now - last[r][1] > stall_s:
                raise DrScaleError(
                    f"{what}: rank {r} made no progress writing its files for {stall_s:.0f} s "
                    f"(at {int(counter) / 2**20:.1f} MiB); the latest checkpoint is still the "
                    "previous one (train.collective_timeout_s sets how long a stall may last)")


def job_store(namespace: str):
    """A namespace of the job's key-value store (the default process group's), or None for a
    single process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.PrefixStore(namespace, dist.distributed_c10d._get_default_store())
