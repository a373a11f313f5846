"""The confirmation of a checkpoint waits for the slowest rank as long as the writes progress,
with a number of store requests per rank that does not grow with the world.

Every rank, while it writes, fsyncs and checksums its files, adds the work it did since its last
report (bytes in its files so far, plus files fsynced and read back) to one counter of the job's
key-value store, every `interval_s`, and when done adds one to a count of ranks done; the rank
that completes the count sets `all done`. The ranks then meet in the confirmation's collective
only once all are done, so a rank whose shared file system is ten minutes slower does not run a
collective into its timeout. Waiting looks at `all done` at growing intervals up to
`interval_s`, and at the shared counter once an interval: per rank, a few requests per interval
whatever the number of ranks (the store's requests are counted: `CountedStore`). When the
counter has not moved for `stall_s`, every rank still writing has stopped (dead, or stuck in the
kernel): the save ends in one line naming them, from one request that reads their marks.
"""
import os
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

import torch.distributed as dist

from dr_scale.errors import DrScaleError


class WriteProgress:
    """This rank's side: `with WriteProgress(store, rank, files, world): ...` reports until
    done."""

    def __init__(self, store, rank: int, files: Iterable, world: int = 1,
                 interval_s: float = 5.0):
        self.store, self.rank, self.world, self.interval_s = store, rank, world, interval_s
        self.files = [Path(f) for f in files]
        self.units = 0  # files fsynced and read back: progress their sizes do not show
        self._reported = 0
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
        now = self.done_so_far()
        if now != self._reported:  # the shared counter moves only by what moved here
            self.store.add(PROGRESS, now - self._reported)
            self._reported = now

    def __enter__(self):
        if self.store is not None:
            self.store.set(f"writing/{self.rank}", "1")  # read only to name a stalled rank
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
            self.store.set(f"writing/{self.rank}", "0")
            # also after a failure: the failure is confirmed in the collective after
            if self.store.add(DONE, 1) == self.world:
                self.store.set(ALL_DONE, "1")
        return False


PROGRESS, DONE, ALL_DONE = "progress", "done", "all_done"


def wait_for_writers(store, world: int, what: str, stall_s: float, interval_s: float = 5.0):
    """Block until every rank is done; raise one line naming the ranks still writing when the
    shared progress counter has not moved for `stall_s` seconds. Looks at `all done` after
    20 ms, then at twice the wait each time up to `interval_s` (torch's blocking store wait
    logs a warning each time it runs out, on every rank), and at the counter every
    `interval_s`."""
    last, since = None, time.monotonic()
    poll, looked = 0.02, time.monotonic()
    while not store.check([ALL_DONE]):
        time.sleep(poll)
        poll = min(interval_s, poll * 2)
        now = time.monotonic()
        if now - looked < interval_s:
            continue
        looked = now
        counter = int(store.add(PROGRESS, 0))
        if counter != last:
            last, since = counter, now
        elif now - since > stall_s:
            marks = store.multi_get([f"writing/{r}" for r in range(world)])
            silent = [r for r, mark in enumerate(marks) if mark != b"0"]
            named = ", ".join(map(str, silent[:8])) + (f" and {len(silent) - 8} more"
                                                       if len(silent) > 8 else "")
            raise DrScaleError(
                f"{what}: rank(s) {named} made no progress writing their files for "
                f"{stall_s:.0f} s; the latest checkpoint is still the previous one "
                "(train.collective_timeout_s sets how long a stall may last)")


class CountedStore:
    """The job's store with its requests counted (`requests`, per process), so the traffic of
    a save can be measured at any number of ranks."""
    requests = 0

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def counted(*args, **kwargs):
            CountedStore.requests += 1
            return method(*args, **kwargs)
        return counted


def job_store(namespace: str):
    """A namespace of the job's key-value store (the default process group's), or None for a
    single process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return CountedStore(dist.PrefixStore(namespace,
                                         dist.distributed_c10d._get_default_store()))
