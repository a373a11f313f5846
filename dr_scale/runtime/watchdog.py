"""Hangs that name themselves: a heartbeat per rank in the job's store, and a step deadline that
follows the run's own pace.

Timeouts come in tiers. Start-up and everything outside the training steps keep the process
group's `train.collective_timeout_s`; a checkpoint's confirmation waits as long as the writes
progress (checkpoint/write_progress.py); a training step (and the per-step agreement after it)
may take `train.step_timeout_factor` times the median of the steps so far, and never less than
`train.step_timeout_min_s`. A rank whose step passes that deadline is waiting on another rank
in a collective (gloo and NCCL alike block without a word). It reads every rank's heartbeat
(host, pid, phase, step, the last of our collectives, when it last beat) in one request, names
the ranks whose heartbeat stopped (a SIGSTOPped or swapped-out process, a dead node) or that
are behind in the steps (stuck in a kernel or a read while their heartbeat thread still runs),
and ends this process in one line with the exit code of a fault, which the sbatch script
requeues. Every surviving rank does the same, so every rank's error names the silent ones.

Its traffic does not grow with the world: a rank writes one key every `interval_s`, and reads
the others' only once, when its deadline passed. It keeps its own connection to the store with
a short timeout, so a silent rank 0 (whose process hosts the store under the deepspeed
launcher) is named too, as the store's host, instead of blocking the reader.
"""
import datetime
import json
import os
import statistics
import threading
import time
from typing import List, Optional

from dr_scale.errors import EXIT_FAULT
from dr_scale.runtime import hangs, suspects
from dr_scale.runtime.ranks import say_error

STALE_BEATS = 3  # a heartbeat this many intervals old has stopped
WARM_STEPS = 2   # the first steps (compilation, autotuning, warm caches) keep the start-up tier


def _store(timeout_s: float):
    """A client connection of our own to the job's TCP store, or None where there is none."""
    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    store = dist.TCPStore(addr, int(port), is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore("dr_scale_heartbeat/", store)


class Watchdog:
    """A thread beats and watches; the trainer marks each step with `begin` and `end`."""

    def __init__(self, rank: int, world: int, factor: float, min_s: float,
                 interval_s: float = 5.0, store=None, exit_fn=None, run_dir=None):
        self.rank, self.world, self.factor, self.min_s = rank, world, factor, min_s
        self.interval_s = interval_s
        self.store, self.run_dir = store, run_dir
        self.host = suspects.node_name()
        self.step = 0
        self.durations: List[float] = []
        self._started: Optional[float] = None
        self._what, self._timed = "", True
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._exit = exit_fn or _leave
        self._thread = threading.Thread(target=self._loop, name="dr_scale watchdog", daemon=True)

    @classmethod
    def for_run(cls, topology, train_cfg, run_dir=None):
        store = _store(timeout_s=10.0)
        return cls(topology.rank, topology.world, train_cfg.step_timeout_factor,
                   train_cfg.step_timeout_min_s, store=store, run_dir=run_dir)

    def start(self):
        if self.store is not None:
            self._beat()
            self._thread.start()
        return self

    def close(self):
        self._stop.set()

    def deadline_s(self) -> float:
        median = statistics.median(self.durations[-50:]) if self.durations else 0.0
        return max(self.min_s, self.factor * median)

    def begin(self, step: int, what: str, timed: bool = True):
        with self._lock:
            self.step, self._what, self._timed = step, what, timed
            self._started = time.monotonic()

    def end(self):
        with self._lock:
            if self._started is not None and self._timed:
                self.durations.append(time.monotonic() - self._started)
            self._started = None

    # -- the thread ----------------------------------------------------------------------------
    def _beat(self):
        self.store.set(str(self.rank), json.dumps({
            "host": self.host, "pid": os.getpid(), "phase": hangs.activity(), "step": self.step,
            "collective": hangs.last_collective(), "t": time.time()}))

    def _loop(self):
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store's host is silent: found at a deadline
                pass
            with self._lock:
                started, what = self._started, self._what
                settled = len(self.durations) >= WARM_STEPS
            if settled and started is not None and time.monotonic() - started > self.deadline_s():
                self._exit(self.verdict(time.monotonic() - started, what))
                return

    def verdict(self, waited_s: float, what: str) -> str:
        """The one line: how long this rank waited in what, and who is silent."""
        head = (f"{what} waited {waited_s:.0f} s (the deadline: {self.deadline_s():.0f} s = "
                f"max(train.step_timeout_min_s, train.step_timeout_factor x the median step "
                f"{statistics.median(self.durations) if self.durations else 0:.2f} s))")
        try:
            beats = self.store.multi_get([str(r) for r in range(self.world)])
        except Exception:  # noqa: BLE001 - timed out: the store's host process is silent
            return (f"{head}; the job's store (hosted by rank 0's process, "
                    f"{os.environ.get('MASTER_ADDR')}) does not answer: rank 0 is silent")
        now = time.time()
        line = silent_ranks(beats, self.step, self.interval_s, now)
        hosts = {r: b["host"] for r, b in _stopped(_parsed(beats), now, self.interval_s)
                 if b is not None}  # the node of one that never beat is unknown
        if hosts and self.rank == min(set(range(self.world)) - set(hosts)):
            suspects.note(self.run_dir, hosts.values(), f"heartbeat stopped: {line}")
        return f"{head}; {line}"


def _parsed(beats: list) -> list:
    """[(rank, heartbeat or None)] from every rank's heartbeat (bytes of JSON, or empty)."""
    out = []
    for rank, raw in enumerate(beats):
        try:
            out.append((rank, json.loads(raw)))
        except (ValueError, TypeError):
            out.append((rank, None))
    return out


def _stopped(parsed: list, now: float, interval_s: float) -> list:
    return [(r, b) for r, b in parsed if b is None or now - b["t"] > STALE_BEATS * interval_s]


def silent_ranks(beats: list, my_step: int, interval_s: float, now: Optional[float] = None
                 ) -> str:
    """Which ranks to blame, from every rank's heartbeat: those whose heartbeat stopped, else
    those behind in the steps, else those in another phase."""
    now = time.time() if now is None else now
    parsed = _parsed(beats)
    stopped = _stopped(parsed, now, interval_s)
    if stopped:
        return "silent: " + _listed(stopped, now, "no heartbeat for")
    behind = [(r, b) for r, b in parsed if b["step"] < my_step]
    if behind:
        return "behind: " + _listed(behind, now, "heartbeat")
    phases = [b["phase"] for _, b in parsed]
    common = max(set(phases), key=phases.count)
    elsewhere = [(r, b) for r, b in parsed if b["phase"] != common]
    if elsewhere:
        return f"elsewhere (the others in '{common}'): " + _listed(elsewhere, now, "heartbeat")
    return f"every rank's heartbeat is recent, all in '{common}'"


def _listed(entries, now: float, age: str) -> str:
    parts = []
    for rank, beat in entries[:8]:
        if beat is None:
            parts.append(f"rank {rank} (never beat)")
        else:
            parts.append(f"rank {rank} on {beat['host']} pid {beat['pid']} at step "
                         f"{beat['step']} in '{beat['phase']}', last collective "
                         f"'{beat['collective']}', {age} {now - beat['t']:.0f} s")
    more = f" and {len(entries) - 8} more" if len(entries) > 8 else ""
    return "; ".join(parts) + more


def _leave(line: str):
    say_error(line)
    os._exit(EXIT_FAULT)  # the main thread is blocked in a collective: it cannot be raised into
