"""dr_scale's own collectives (evaluation totals, metrics, memory, callbacks, sequence
parallelism), each placing its tensors on a device the process group serves.

On GPUs DeepSpeed starts torch's group with NCCL alone, which serves CUDA tensors only: a host
tensor handed to it fails ("No backend type associated with device type cpu"). Every collective
in dr_scale goes through here (tests/test_comm.py checks that none calls torch.distributed
directly), so a host-side total works on gloo and NCCL alike, and a tensor already on a served
device is used in place, with no copy.
"""
from typing import List

import torch
import torch.distributed as dist

from dr_scale.runtime import hangs

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def comm_device(tensor: torch.Tensor, group=None) -> torch.device:
    """Where `tensor` must be for `group`: its own device when the group serves that device type,
    else the first device type the group serves (the current device of that type)."""
    served = _served_types(group)
    if not served or tensor.device.type in served:
        return tensor.device
    return torch.device(served[0])


def _served_types(group) -> List[str]:
    pg = group or dist.group.WORLD
    return [d.type for d in getattr(pg, "_device_types", ())]


def _placed(tensor, group):
    device = comm_device(tensor, group)
    return tensor if device == tensor.device else tensor.to(device)


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Reduced over the group. In place (and returned) where the tensor is already on a served
    device; otherwise a copy travels and the result is written back into `tensor`."""
    hangs.entering(f"all_reduce {op}")
    moved = _placed(tensor, group)
    dist.all_reduce(moved, op=_OPS[op], group=group)
    if moved is not tensor:
        tensor.copy_(moved)
    return tensor


def all_gather(parts: List[torch.Tensor], tensor: torch.Tensor, group=None):
    """`parts[i]` = rank i's `tensor` (parts preallocated like `tensor`)."""
    hangs.entering("all_gather")
    moved = _placed(tensor, group)
    out = parts if moved is tensor else [torch.empty_like(moved) for _ in parts]
    dist.all_gather(out, moved.contiguous(), group=group)
    if out is not parts:
        for p, o in zip(parts, out):
            p.copy_(o)


def reduce_scatter(out: torch.Tensor, parts: List[torch.Tensor], group=None):
    """`out` = the sum over ranks of their `parts[this rank]`."""
    hangs.entering("reduce_scatter")
    moved = _placed(out, group)
    dist.reduce_scatter(moved, [_placed(p, group) for p in parts], group=group)
    if moved is not out:
        out.copy_(moved)


def barrier(group=None):
    hangs.entering("barrier")
    dist.barrier(group=group)


def broadcast_object(obj, src: int = 0, group=None):
    """Rank `src`'s picklable `obj` on every rank (torch places the bytes itself)."""
    hangs.entering(f"broadcast_object from rank {src}")
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def decided_by_rank0(decide):
    """`decide()` run on rank 0 alone (a measurement, a cache read), its answer given to every
    rank; where it raised a DrScaleError, every rank raises that error: none waits forever on a
    rank that failed. Without a group of several ranks, `decide()` itself."""
    several = dist.is_initialized() and dist.get_world_size() > 1
    answer = None
    if not several or dist.get_rank() == 0:
        from dr_scale.errors import DrScaleError

        try:
            answer = decide()
        except DrScaleError as e:
            if not several:
                raise
            answer = e
    if several:
        answer = broadcast_object(answer)
    if isinstance(answer, Exception):
        raise answer
    return answer


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable `obj`, in rank order."""
    hangs.entering("all_gather_object")
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out

