"""This rank's slices of the fp32 master weights, under any ZeRO stage, without communication.

Each Shard is one parameter's slice held here: its flat range [start, start + numel) in the
parameter as this rank holds it, a view of the fp32 master values (what the optimizer updates),
and a view of the low-precision copy the forward pass reads (None where the master is the
parameter itself). Under expert parallelism a rank holds some experts of each stacked expert
tensor: `base` places its part in the whole tensor (`shape`), so slices saved by every rank
assemble into the whole.
"""
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from dr_scale.runtime import comm
from dr_scale.compat.grads import data_parallel_group
from dr_scale.parallel.expert import expert_slice


@dataclass
class Shard:
    name: str
    shape: tuple
    start: int
    numel: int
    master: torch.Tensor           # fp32, flat, `numel` elements
    lp: Optional[torch.Tensor]     # flat view the forward reads, or None
    base: int = 0                  # where this rank's part of the parameter starts in the whole
    expert: bool = False           # split by expert parallelism (its ZeRO partitions and replicas
                                   # are over the expert-data group)

    @property
    def whole_start(self) -> int:
        return self.base + self.start


def local_shards(engine) -> List[Shard]:
    out = []
    opt = engine.optimizer
    zero0_masters = _zero0_masters(opt)
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if hasattr(p, "ds_tensor"):  # ZeRO-3: a contiguous slice per rank, padded at the end
            from deepspeed.utils import safe_get_local_fp32_param

            part = p.ds_tensor.numel()
            start = dist.get_rank(group=p.ds_process_group) * part
            numel = max(0, min(part, p.ds_numel - start))
            master = safe_get_local_fp32_param(p).view(-1)[:numel]
            out.append(Shard(name, tuple(p.ds_shape), start, numel, master,
                             p.ds_tensor.view(-1)[:numel]))
        elif getattr(p, "_hp_mapping", None) is not None:  # ZeRO-1/2 fragments
            m = p._hp_mapping
            addr = m.lp_fragment_address
            out.append(Shard(name, tuple(p.shape), addr.start, addr.numel,
                             m.hp_fragment.view(-1), p.data.view(-1).narrow(0, addr.start,
                                                                           addr.numel)))
        elif id(p) in zero0_masters:  # ZeRO-0 with bf16/fp16: whole fp32 copies
            out.append(Shard(name, tuple(p.shape), 0, p.numel(),
                             zero0_masters[id(p)].view(-1), p.data.view(-1)))
        elif p.dtype == torch.float32 and not hasattr(opt, "bit16_groups"):
            out.append(Shard(name, tuple(p.shape), 0, p.numel(), p.data.view(-1), None))
        # else: ZeRO-1/2 gave this rank no fragment of p
        placed = expert_slice(p)
        if placed is not None and out and out[-1].name == name:
            first, num_experts = placed
            per_expert = p.numel() // p.shape[0]
            out[-1].base, out[-1].expert = first * per_expert, True
            out[-1].shape = (num_experts, *p.shape[1:])
    return out


def _zero0_masters(opt) -> dict:
    """id(low-precision param) -> its fp32 master, for DeepSpeed's ZeRO-0 mixed-precision wrapper."""
    lp_groups = getattr(opt, "fp16_groups", None)
    hp_groups = getattr(opt, "fp32_groups", None)
    if not lp_groups or not hp_groups:
        return {}
    return {id(lp): hp for lg, hg in zip(lp_groups, hp_groups) for lp, hp in zip(lg, hg)}


def write_values(engine, shards: List[Shard], values: List[torch.Tensor], topology):
    """Make the forward pass read ``values`` (one per shard). ZeRO-3 ranks write their own
    partitions (the forward gathers them); under ZeRO-1/2 each parameter as this rank holds it is
    assembled from the fragments of the ranks that share it (an all-reduce per parameter, on
    every rank in the same order): the data-parallel group, or for experts split by expert
    parallelism (the run's Topology) their expert-data group; tensor ranks hold different slices
    and stay apart."""
    gather = engine.zero_optimization_stage() in (1, 2)
    mine = {s.name: (s, v) for s, v in zip(shards, values)}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        entry = mine.get(name)
        if hasattr(p, "ds_tensor"):
            if entry is not None:
                entry[0].lp.copy_(entry[1])
            continue
        if entry is not None and entry[0].lp is None:  # fp32 ZeRO-0: the parameter is the master
            entry[0].master.copy_(entry[1])
            continue
        full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if entry is not None:
            full.narrow(0, entry[0].start, entry[0].numel).copy_(entry[1])
        if gather:  # fragments are disjoint across the group: their sum is p
            comm.all_reduce(full, group=topology.expert_data_group if expert_slice(p)
                            else data_parallel_group(engine))
        p.data.copy_(full.view_as(p))
