"""Run by tests/test_checkpoint_writer.py and benchmarks/control_plane.py on N ranks
(torch.multiprocessing, gloo): three saves published while the last rank starts each one
`late_s` late, so the others wait through many slices; each rank reports the job-store requests
each save cost it, and the seconds its share of a resume's checksum check took."""
import os
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_result import write_and_leave


def rank_main(rank, port, world, ckpt_dir, out, late_s, mib):
    from dr_scale.checkpoint import manifest
    from dr_scale.checkpoint.layout import STAGING, tag_for
    from dr_scale.checkpoint.write_progress import CountedStore
    from dr_scale.checkpoint.writer import CheckpointWriter
    from dr_scale.parallel.topology import Topology
    from dr_scale.runtime import comm

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ckpt_dir = Path(ckpt_dir)
    engine = types.SimpleNamespace(checkpoint_engine=None, zero_optimization_stage=lambda: 1)
    writer = CheckpointWriter(engine, ckpt_dir, Topology(world, rank=rank), timeout_s=60)
    writer.progress_interval_s = 0.2
    per_save = []
    for step in (1, 2, 3):
        folder = ckpt_dir / STAGING / tag_for(step)
        folder.mkdir(parents=True, exist_ok=True)
        mine = folder / f"rank{rank}.bin"
        mine.write_bytes(os.urandom(mib * 2**20 // world))  # one checkpoint's size, split
        dist.barrier()
        if rank == world - 1:
            time.sleep(late_s)
        before = CountedStore.requests
        writer.publish(tag_for(step), [mine], position=(step, step))
        per_save.append(CountedStore.requests - before)
    # a resume's check of the last one: this rank's share, then one all-reduce
    tag_dir = ckpt_dir / tag_for(3)
    body = manifest.read(tag_dir)
    dist.barrier()
    t0 = time.perf_counter()
    fault = manifest.share_fault(tag_dir, body, rank, world)
    flag = torch.tensor([rank if fault else world])
    comm.all_reduce(flag, op="min")
    write_and_leave(out, rank, {"requests_per_save": per_save, "fault": int(flag),
                                "verify_s": time.perf_counter() - t0,
                                "share": manifest.share(body, rank, world)})


if __name__ == "__main__":
    port, world = int(sys.argv[1]), int(sys.argv[2])
    mp.spawn(rank_main, args=(port, world, *sys.argv[3:5], float(sys.argv[5]), int(sys.argv[6])),
             nprocs=world)
