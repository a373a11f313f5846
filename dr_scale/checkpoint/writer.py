"""Writing a checkpoint: every rank's files made durable by that rank, `latest` moved only when
all ranks confirm, old checkpoints deleted in a thread of rank 0's; synchronous, or
asynchronous with the files written behind the next step's compute.

The layout and its crash guarantee are layout.py's: files go to checkpoints/.incoming/<tag>/,
rank 0 renames the folder to checkpoints/<tag>/ and only then names it in checkpoints/latest. A
crash at any moment before that leaves the previous checkpoint the latest one.

Which files a rank wrote is known exactly: DeepSpeed writes each through its checkpoint engine
(`engine.checkpoint_engine.save`), and `FileLedger` stands in for that engine. On a parallel file system
a rank's fsync flushes its own writes only, so each rank fsyncs what it wrote, all at once.

Asynchronous saves (`train.async_save`). Measured on this project's CPUs, the cost of a save is
the write of the state DeepSpeed hands its engine (torch.save + fsync); building those state
dicts takes milliseconds, and they hold the live tensors. With `train.async_snapshot` (the
default) the loop copies them to host memory (snapshot.py: pinned pages from a GPU; a memcpy on
CPU ranks) and a writer thread writes the copy while training goes on: the loop waits for the
copy only. Without it nothing is copied: the thread writes the live tensors behind the next
step's forward and backward and the loop waits before the next optimizer step changes them
(`before_update`): for runs without host memory for a second copy of the optimizer state
(llama_1b on one rank here peaks at 21.6 GiB of a 23 GiB machine). Why a thread of ours and not
torch DCP's async_save (which stages such a copy too): DCP writes its own format, which neither
DeepSpeed's loader nor ds_to_universal reads; DeepSpeed's decoupled engine writes through the
async-I/O op (libaio), which this project cannot require. The confirmation (every rank wrote and
fsynced) runs in the thread over a gloo group of its own, so it never interleaves with the
training loop's collectives (torch's DCP async_save keeps a separate group for the same reason),
and it starts only when every rank is done, waiting for the slowest as long as its writes
progress (write_progress.py).
"""
import datetime
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from dr_scale.runtime import comm, nvme_offload
from dr_scale.errors import DrScaleError
from dr_scale.checkpoint import manifest
from dr_scale.checkpoint.snapshot import SnapshotBuffers, host_snapshot
from dr_scale.checkpoint.write_progress import WriteProgress, job_store, wait_for_writers
from dr_scale.checkpoint.layout import (LATEST, REHEARSAL, STAGING, STATE_FILE, complete_tags,
                                       fsync_dir, fsync_file, set_aside, set_aside_earlier,
                                       tag_for, write_atomic)


class FileLedger:
    """Stands in for DeepSpeed's checkpoint engine: keeps each (state dict, path) DeepSpeed asks
    to write, to be written after `save_checkpoint` returns. Then no write happens between
    DeepSpeed's own collectives, so a rank whose write fails (a full disk) can still meet the
    others in the confirmation and all of them stop in one line instead of waiting."""

    def __init__(self, inner, expert_writer=None):
        self.inner = inner
        self.deferred: list = []
        self.expert_writer = expert_writer

    def is_data_parallel_writer(self, rank) -> bool:
        """DeepSpeed asks it with the rank in the expert-data group only (its expert-parallel
        save); `expert_writer` answers then, where given."""
        if self.expert_writer is not None:
            return self.expert_writer(rank)
        return self.inner.is_data_parallel_writer(rank)

    def save(self, state_dict, path: str):
        self.deferred.append((state_dict, path))

    def take(self) -> list:
        out, self.deferred = self.deferred, []
        return out

    def __getattr__(self, name):  # create, load, commit, makedirs, is_decoupled, ...
        return getattr(self.inner, name)


def expert_writer(topology):
    """Whether this rank writes for its expert-data group (expert parallelism): one rank per
    tensor rank, the first data-parallel replica of its experts. DeepSpeed's save lets only the
    group's rank 0 write, and under tensor parallelism the group holds the tensor group's ranks
    too, so the other tensor ranks would write neither their copy of the experts nor their
    model-states file, which the load needs one of per tensor rank. Decided by this rank's own
    place, not by the rank number DeepSpeed passes: torch numbers a group's ranks in sorted
    order, not in the order they were listed (8 ranks, TP 2 x EP 2: the group {0, 4, 1, 5}
    numbers 0, 1, 4, 5, and the arithmetic on its numbers chose two tensor-rank-0 writers)."""
    if not topology.experts_split:
        return None
    first_replica = topology.data_rank < topology.expert  # experts: data_rank % expert
    return lambda _group_rank: first_replica


class CheckpointWriter:
    def __init__(self, engine, ckpt_dir: Path, topology, keep_last: int = 0,
                 asynchronous: bool = False, timeout_s: int = 600, snapshot: bool = True):
        """`topology`: the run's (this rank's place); `timeout_s`: how long a rank's writes may
        make no progress before the save fails; `snapshot`: an asynchronous save writes from a
        copy in host memory (else from the live tensors, waiting before the next update)."""
        self.engine, self.ckpt_dir, self.rank = engine, Path(ckpt_dir), topology.rank
        self.world, self.stall_s, self.snapshot = topology.world, timeout_s, snapshot
        self.progress_interval_s = 5.0  # how often a rank reports its writes, and waiters look
        self._saves = 0  # numbers each save's namespace in the job's store (same on every rank)
        self._buffers = SnapshotBuffers() if asynchronous and snapshot else None
        self._prepared = False  # prepare_snapshot has run
        self.layout = {"world": topology.world, "tensor": topology.tensor,
                       "pipeline": topology.pipeline, "zero_stage": engine.zero_optimization_stage()}
        self.keep_last, self.asynchronous = keep_last, asynchronous
        self.ledger = FileLedger(engine.checkpoint_engine, expert_writer(topology))
        engine.checkpoint_engine = self.ledger
        # the thread's own group: its collectives never interleave with the loop's
        self.group = (dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
                      if asynchronous else None)
        self._thread: Optional[threading.Thread] = None
        self._writes_done = threading.Event()
        self._error: Optional[BaseException] = None
        self._pending: Optional[tuple] = None  # (step, path) of the save in flight
        self._blocked_s = 0.0  # how long the loop has waited for the save in flight
        self._deleter: Optional[threading.Thread] = None

    # -- the loop's side -----------------------------------------------------------------------
    def save(self, step: int, state: dict) -> Optional[tuple]:
        """Write the checkpoint of `step`. Synchronous: (step, path, seconds the loop waited)
        once complete. Asynchronous: None at once; `wait` returns that triple when complete."""
        self.wait()  # one save at a time
        t0 = time.perf_counter()
        tag, rank = tag_for(step), self.rank
        staging = self.ckpt_dir / STAGING
        from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO,
                                                    UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                    UNIVERSAL_CHECKPOINT_VERSION_VALUE)

        # universal_checkpoint_info lets DeepSpeed's ds_to_universal reshard this one later.
        # The engine writes AutoTP's record (which parameters are row-parallel, replicated,
        # vocabulary-sliced) under the same key, then updates the state with ours: ours must
        # carry it, or the conversion joins row-parallel slices on the wrong dimension.
        info = dict(getattr(self.engine.module, UNIVERSAL_CHECKPOINT_INFO, None) or {})
        info.setdefault(UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE)
        client_state = {"dr_scale_step": step, UNIVERSAL_CHECKPOINT_INFO: info}
        if self.engine.has_moe_layers:  # its expert-parallel save writes the record itself
            del client_state[UNIVERSAL_CHECKPOINT_INFO]   # (from the module's) and refuses ours
        self.ledger.take()
        try:
            self.engine.save_checkpoint(str(staging), tag=tag, client_state=client_state,
                                        save_latest=False)
        finally:
            writes = self.ledger.take()
        copied = nvme_offload.saved_swap_files(self.engine, staging / tag)  # zero3_nvme's
        position = (step, int(state.get("consumed_samples", 0)))
        state_path = str(staging / tag / STATE_FILE.format(rank=rank))
        self._prepared = True  # this save's snapshot leaves its buffers for the next
        if self.asynchronous and self.snapshot:  # everything copied; the loop goes on at once
            writes = host_snapshot([*writes, (state, state_path)], buffers=self._buffers)
        else:  # ours on the host, copied when written behind the loop: the callbacks' state
            # in it (EMA weights) changes after every step, not only at the optimizer's
            writes.append((host_snapshot(state, clone_cpu=self.asynchronous), state_path))
        if not self.asynchronous:
            path = self.publish(tag, [], writes=writes, copied=copied, position=position)
            return step, path, time.perf_counter() - t0
        if self.snapshot:
            self._writes_done.set()  # the weights may change at once
        else:
            self._writes_done.clear()
        self._error = None
        self._pending = (step, self.ckpt_dir / tag)
        self._thread = threading.Thread(target=self._write_and_commit,
                                        args=(tag, writes, copied, position),
                                        name=f"dr_scale checkpoint {tag}", daemon=True)
        self._thread.start()
        self._blocked_s = time.perf_counter() - t0
        return None

    def prepare_snapshot(self, state: Callable[[], dict]):
        """Before the first asynchronous save: rehearse it (DeepSpeed builds its state dicts
        through the ledger; nothing is written, the folder it made is removed) to learn the
        sizes of the buffers its snapshot needs, and map them in a background thread. The
        first save then waits for a copy only, as the later ones do. Not with NVMe offload:
        DeepSpeed's save copies the swap files itself, and such runs keep no snapshot.
        `state`: makes our state (the trainer's state_dict), called only when it is needed:
        this is asked after every step and does something once."""
        if self._buffers is None or self._prepared or self.engine.zero_nvme_offload_optimizer():
            return
        self._prepared = True
        rehearsal = self.ckpt_dir / REHEARSAL
        self.ledger.take()
        try:
            self.engine.save_checkpoint(str(rehearsal), tag="rehearsal", save_latest=False,
                                        client_state={"dr_scale_step": 0})
        finally:
            writes = self.ledger.take()
        if self.rank == 0:  # DeepSpeed's save ends in a barrier: no rank uses the folder now
            shutil.rmtree(rehearsal, ignore_errors=True)
        self._buffers.prepare([*[state_dict for state_dict, _ in writes], state()])

    def before_update(self):
        """Before the optimizer changes the weights and its state: this rank's files of an
        asynchronous save must be written (they are serialised from the live tensors)."""
        if self._thread is not None and not self._writes_done.is_set():
            t0 = time.perf_counter()
            while not self._writes_done.wait(0.05):
                if not self._thread.is_alive():
                    break
            self._blocked_s += time.perf_counter() - t0
        self._raise_error()

    def idle(self) -> bool:
        """No asynchronous save in flight on this rank (finished ones not yet collected count
        as idle: `wait` returns them at once)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Optional[tuple]:
        """Block until the save in flight (if any) is complete; (step, path, seconds the loop
        waited for it in all) of it."""
        if self._thread is None:
            return None
        t0 = time.perf_counter()
        self._thread.join()
        self._blocked_s += time.perf_counter() - t0
        return self._join()

    def _join(self):
        self._thread.join()
        self._thread = None
        try:
            self._raise_error()
        finally:
            done, self._pending = self._pending, None
        return (*done, self._blocked_s)

    def _raise_error(self):
        if self._error is not None:
            err, self._error = self._error, None
            step = self._pending[0] if self._pending else "?"
            if isinstance(err, DrScaleError):
                raise err
            raise DrScaleError(f"checkpoint save at step {step} (asynchronous): "
                               f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")

    # -- the writing side ----------------------------------------------------------------------
    def _write(self, writes: list) -> Optional[str]:
        """Write the state dicts (DeepSpeed's and ours); the first failure as a line, else
        None."""
        for state_dict, path in writes:
            failure = _written(lambda: self.ledger.inner.save(state_dict, path), path)
            if failure:
                return failure
        return None

    def _write_and_commit(self, tag: str, writes: list, copied: List[Path], position: tuple):
        try:
            self.publish(tag, [], writes=writes, copied=copied, group=self.group,
                         position=position, after_writes=self._writes_done.set)
        except BaseException as e:  # noqa: BLE001 - reported to the loop at its next wait
            self._error = e
        finally:
            self._writes_done.set()

    def publish(self, tag: str, files: List[Path], group=None, failure: Optional[str] = None,
                position: tuple = (0, 0), writes: Optional[list] = None,
                copied: List[Path] = (), after_writes=None) -> Path:
        """Each rank writes `writes` (state dicts and paths), fsyncs and checksums what it wrote
        (`files` written before, `copied`, and those), reporting its progress; when every rank
        is done and confirms, rank 0 writes the manifest (manifest.py) and publishes.
        `failure`: this rank could not write its files (the line says why); `position`:
        (step, samples consumed); `after_writes`: called once the state dicts are written (the
        live tensors free to change)."""
        staging, final = self.ckpt_dir / STAGING, self.ckpt_dir / tag
        writes = writes if writes is not None else []
        files = [*map(Path, files), *(Path(p) for _, p in writes), *map(Path, copied)]
        self._saves += 1
        store = job_store(f"dr_scale_checkpoint/{self._saves}/") if self.world > 1 else None
        ok = torch.tensor([1.0])
        described = {}
        with WriteProgress(store, self.rank, files, self.world,
                           self.progress_interval_s) as progress:
            failure = failure or self._write(writes)
            if after_writes is not None:
                after_writes()
            writes.clear()  # the caller's list too: its tensors (live ones, or a snapshot's) go
            try:
                for f in [] if failure else files:
                    fsync_file(f)
                    progress.advance()
                for d in [] if failure else sorted({f.parent for f in files}):
                    fsync_dir(d)  # their names too (zero3_nvme's swap files: a folder a rank)
                if not failure:  # read back from the page cache, on every rank at once
                    described = manifest.describe(files, staging / tag)
            except OSError as e:
                failure = f"{e.filename}: {e.strerror}"
        if failure:
            ok.zero_()
        failed = failure or ""
        if store is not None:  # the collective below starts when every rank is done
            wait_for_writers(store, self.world, f"checkpoint {tag}", self.stall_s,
                             self.progress_interval_s)
        comm.all_reduce(ok, op="min", group=group)
        if not ok.item():
            raise DrScaleError(f"checkpoint {tag}: " + (failed or "another rank could not write "
                               "its files") + f"; {self.ckpt_dir / LATEST} still names the "
                               "previous checkpoint")
        per_rank = comm.all_gather_object(described, group=group)
        if self.rank == 0:
            manifest.write(staging / tag, {k: v for d in per_rank for k, v in d.items()},
                           *position, self.layout)  # the last file of the checkpoint
            for d in sorted({f.parent for f in files} | {staging / tag}):
                fsync_dir(d)  # the new names in the folder, where this rank made them
            # the same step saved again after a rollback: the old folder and every universal
            # form converted from it are renamed aside first (one rename each: no moment where
            # the tag names a half-deleted folder, no later load of the old timeline's
            # conversion), then deleted behind the loop
            replaced = set_aside(self.ckpt_dir, tag)
            os.rename(staging / tag, final)
            for script in staging.glob("*.py"):  # DeepSpeed's zero_to_fp32.py and friends
                os.replace(script, self.ckpt_dir / script.name)
            try:
                staging.rmdir()  # exists only while a checkpoint is being written
            except OSError:
                pass
            fsync_dir(self.ckpt_dir)
            write_atomic(self.ckpt_dir / LATEST, tag + "\n")
        comm.barrier(group=group)  # the checkpoint is complete for every rank
        if self.rank == 0:
            old = [t for t in complete_tags(self.ckpt_dir)[:-self.keep_last] if t != tag] \
                if self.keep_last > 0 else []
            earlier = set_aside_earlier(self.ckpt_dir)  # those just replaced among them
            self._delete(list(dict.fromkeys(
                [*replaced, *earlier, *(f for t in old for f in set_aside(self.ckpt_dir, t))])))
        return final

    def _delete(self, folders: List[Path]):
        """Old checkpoints are renamed aside at once (set_aside) and deleted in a thread of
        their own: deleting a 70B one (~1 TB in many files on a parallel file system) takes
        minutes that neither rank 0 nor the ranks waiting for it at the next collective need
        to spend. One deleting thread at a time; `finish_deletes` waits for it at the end of a
        run; a run stopped before it finished leaves the renamed folders to the next run's."""
        if not folders:
            return
        previous = self._deleter

        def delete():
            if previous is not None:
                previous.join()
            for folder in folders:
                shutil.rmtree(folder, ignore_errors=True)
        self._deleter = threading.Thread(target=delete, name="dr_scale checkpoint deletes",
                                         daemon=True)
        self._deleter.start()

    def finish_deletes(self):
        if self._deleter is not None:
            self._deleter.join()
            self._deleter = None


def _written(write, path) -> Optional[str]:
    """Run `write`; None when it worked, else one line naming the file, the error and the free
    space (torch reports a full disk as 'unexpected pos', not as an OSError)."""
    try:
        write()
        return None
    except (OSError, RuntimeError) as e:
        folder = Path(path).parent
        try:
            free = f"{shutil.disk_usage(folder).free / 2**30:.1f} GiB free there"
        except OSError:
            free = "free space unknown"
        detail = getattr(e, "strerror", None) or str(e).strip().splitlines()[-1][:120]
        return f"{path}: could not be written ({detail}; {free})"
