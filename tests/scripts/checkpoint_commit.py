"""Run by tests/test_checkpoint_writer.py on 2 ranks (torch.multiprocessing, gloo): each rank
publishes the files it wrote; `latest` moves only when both ranks confirm theirs."""
import os
import sys
import types
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp
from rank_result import write_and_leave


def rank_main(rank, port, ckpt_dir, out):
    from dr_scale.errors import DrScaleError
    from dr_scale.checkpoint.layout import STAGING, tag_for
    from dr_scale.parallel.topology import Topology
    from dr_scale.checkpoint.writer import CheckpointWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ckpt_dir = Path(ckpt_dir)
    # publish() needs no engine: the files are the ranks' own (the stage goes in the manifest)
    engine = types.SimpleNamespace(checkpoint_engine=None, zero_optimization_stage=lambda: 1)
    writer = CheckpointWriter(engine, ckpt_dir,
                              Topology(2, rank=rank), keep_last=2)
    result = {}
    if rank == 0:  # set aside by an earlier process that ended before deleting it
        (ckpt_dir / ".deleting-step_00000000.1").mkdir(parents=True)
        (ckpt_dir / ".deleting-step_00000000.1" / "rank0.bin").write_bytes(b"old")
    for step in (1, 2, 3, 4):
        folder = ckpt_dir / STAGING / tag_for(step)
        folder.mkdir(parents=True, exist_ok=True)
        mine = folder / f"rank{rank}.bin"
        mine.write_bytes(bytes([rank, step]) * 1000)
        if step == 4 and rank == 1:
            mine.unlink()  # this rank's write was lost
        try:
            writer.publish(tag_for(step), [mine], position=(step, 8 * step))
            result[step] = "published"
        except DrScaleError as e:
            result[step] = str(e)
        dist.barrier()
        result[f"latest_after_{step}"] = (ckpt_dir / "latest").read_text().strip()
        result[f"kept_after_{step}"] = sorted(p.name for p in ckpt_dir.iterdir()
                                              if p.name.startswith("step_"))
    writer.finish_deletes()  # the pruned checkpoints went in rank 0's deleting thread
    dist.barrier()
    result["set_aside_left"] = sorted(p.name for p in ckpt_dir.glob(".deleting-*"))
    write_and_leave(out, rank, result)


if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2], sys.argv[3]), nprocs=2)
