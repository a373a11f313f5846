"""The process group: started through DeepSpeed's accelerator (gloo on CPU, NCCL on GPU), left
together at the end."""
import datetime
import os
import socket

import torch
import torch.distributed as dist

from dr_scale.runtime import comm
from dr_scale.runtime.ranks import local_rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size_from_env() -> int:
    """The world size the launcher (deepspeed, torchrun, srun) announced, before any process
    group exists; a plain `python launchers/pretrain.py` is a world of one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


# torch's NCCL flight recorder: the last collectives of every rank kept in a ring, dumped to a
# file per rank when the watchdog times a collective out (each rank's sequence numbers show
# which rank never entered the collective the others wait in). Set where the user has not.
# TORCH_FR_BUFFER_SIZE is the buffer's name since torch renamed TORCH_NCCL_TRACE_BUFFER_SIZE
# (torch 2.13 warns on the old one on every rank); on a torch older than the rename, set
# TORCH_NCCL_TRACE_BUFFER_SIZE yourself.
NCCL_FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/dr_scale_nccl_trace_rank_"}


def flight_recorder_env(env) -> dict:
    """What NCCL_FLIGHT_RECORDER adds to `env` (the user's settings win)."""
    return {k: v for k, v in NCCL_FLIGHT_RECORDER.items() if k not in env}


def init_distributed(timeout_s: int = 600):
    """(device, ranks on this node): deepspeed.init_distributed with the accelerator's backend
    and a collective timeout of `timeout_s`; a plain `python launchers/pretrain.py` becomes a
    world of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    os.environ.update(flight_recorder_env(os.environ))  # read by NCCL's group at its start
    acc = get_accelerator()
    timeout = datetime.timedelta(seconds=timeout_s)
    # Groups made later (DeepSpeed's data-parallel and ZeRO groups: torch new_group without a
    # timeout) take torch's module default, 30 minutes, not the world group's: with only the
    # world group's set, a rank that stopped responding left the others in a gradient
    # all-reduce past the test's 90 s. So the defaults become ours too.
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    if acc.device_name() == "cpu":
        # DeepSpeed's CPU backend JIT-loads its shared-memory all-reduce op at init (1.1-1.3 s
        # a rank, measured here) and maps a 66 MB /dev/shm buffer per rank that it never
        # unlinks (they filled /dev/shm run after run); the op serves inference_all_reduce
        # only, which training never calls. Marked incompatible, the backend skips it
        # (deepspeed/comm/torch.py, build_shm_op).
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name(), timeout=timeout)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or
                      os.environ.get("WORLD_SIZE", "1"))
    if acc.device_name() == "cpu":
        torch.set_num_threads(threads_per_rank(local_world)[0])
        device = torch.device("cpu")
    else:
        device = torch.device(acc.device_name(device_index(local_rank(),
                                                           acc.device_count())))
        acc.set_device(device.index)
    return device, local_world


def device_index(local_rank: int, visible: int) -> int:
    """The device a rank computes on: its local rank among the devices it sees. A cluster that
    binds one GPU to each task (SLURM's --gpus-per-task, or CUDA_VISIBLE_DEVICES set per task)
    shows every rank a single device, index 0, whatever its local rank."""
    return local_rank % max(1, visible)


def threads_per_rank(local_world: int):
    """(threads per CPU rank, where the figure came from, for the start line):
    DR_SCALE_THREADS_PER_RANK, else OMP_NUM_THREADS when the user (or torchrun's default of 1)
    set it, else cores / ranks on this node (ranks share the cores; more threads than cores
    makes gloo steps erratic)."""
    for var in ("DR_SCALE_THREADS_PER_RANK", "OMP_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value), f"{var}={value}"
    return (max(1, (os.cpu_count() or 1) // max(1, local_world)),
            f"{os.cpu_count()} cores / {local_world} rank(s) on this node")


def close_distributed():
    """Leave the process group together. A rank that exits with gloo's threads still attached
    while its peer is mid-exit can abort in C++ ("terminate called without an active
    exception"), turning a clean stop into a crash code."""
    if dist.is_available() and dist.is_initialized():
        comm.barrier()
        dist.destroy_process_group()
