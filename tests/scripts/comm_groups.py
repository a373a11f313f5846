"""Run by tests/test_comm.py on 2 ranks (torch.multiprocessing): dr_scale.runtime.comm under a world
group that serves CUDA only, as NCCL's does on GPUs, and under a gloo group serving the host."""
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_result import write_and_leave


def rank_main(rank, port, out):
    from dr_scale.runtime import comm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("cuda:gloo", rank=rank, world_size=2)  # serves cuda tensors only
    result = {}
    host = torch.tensor([1.0 + rank], dtype=torch.float64)
    try:
        dist.all_reduce(host.clone())  # the bug: a host tensor straight into such a group
        result["raw"] = "no error"
    except RuntimeError as e:
        result["raw"] = str(e).splitlines()[0]
    result["placed"] = str(comm.comm_device(host))  # where comm would send it
    cpu_group = dist.new_group([0, 1], backend="cpu:gloo")
    result["cpu_group_placed"] = str(comm.comm_device(host, cpu_group))
    t = host.clone()
    result["same_object"] = comm.all_reduce(t, group=cpu_group) is t
    result["sum"] = t.item()
    result["max"] = comm.all_reduce(host.clone(), "max", group=cpu_group).item()
    parts = [torch.empty(3) for _ in range(2)]
    comm.all_gather(parts, torch.arange(3.0) + 10 * rank, group=cpu_group)
    result["gathered"] = [p.tolist() for p in parts]
    out_t = torch.empty(2)
    comm.reduce_scatter(out_t, [torch.full((2,), 1.0 + rank), torch.full((2,), 10.0 + rank)],
                        group=cpu_group)
    result["scattered"] = out_t.tolist()
    result["objects"] = comm.all_gather_object({"rank": rank}, group=cpu_group)
    result["broadcast"] = comm.broadcast_object(f"from {rank}", group=cpu_group)
    comm.barrier(group=cpu_group)
    write_and_leave(out, rank, result)


if __name__ == "__main__":
    mp.spawn(rank_main, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
