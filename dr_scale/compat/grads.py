"""This rank's share of each parameter's reduced gradient, under any ZeRO stage, and the
whole-parameter norms computed from the shares.

Valid between the last micro-batch's backward and the optimizer step (DeepSpeed reduces
gradients at the accumulation boundary; before that they are partial). Every function here is
called on every rank in the same order: the norms take one all-reduce over the data-parallel group.

Where the gradients live:
- ZeRO-3: each rank holds a contiguous slice of every parameter's gradient
  (DeepSpeed's safe_get_local_grad / safe_set_local_grad; the getter may return a copy).
- ZeRO-1/2 (and DeepSpeed's bf16 optimizer): a rank holds a fragment of some parameters and none
  of others (the `_hp_mapping` fragment views, written in place).
- ZeRO-0: every rank holds the whole averaged gradient (`param.grad`, or the fp32 accumulation
  buffer `_hp_grad` under bf16).
"""
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from dr_scale.parallel.expert import expert_slice
from dr_scale.runtime import comm


@dataclass
class LocalGrad:
    name: str
    grad: Optional[torch.Tensor]     # this rank's share (flat), None where it holds none
    partitioned: bool                # shares on the ranks sum (in squares) to the whole norm
    write: Optional[Callable]        # stores a modified share back, where `grad` is a copy
    tp_sharded: bool = False         # a tensor-parallel slice: the norm sums over the TP group
    expert: bool = False             # split by expert parallelism: the norm sums over the
                                     # expert-data group (its shares), then the expert group


def tensor_parallel_params(engine) -> set:
    """ids of parameters that tensor parallelism (DeepSpeed AutoTP) split across its group: the
    weights of its parallel linears and the biases of the column-parallel ones."""
    try:
        from deepspeed.module_inject.layers import LinearAllreduce, TensorParallel_Layer
    except ImportError:
        return set()
    ids = set()
    for m in engine.module.modules():
        if isinstance(m, TensorParallel_Layer):
            for pname, p in m.named_parameters(recurse=False):
                if pname == "weight" or not isinstance(m, LinearAllreduce):
                    ids.add(id(p))
    return ids


def local_grads(engine, topology) -> List[LocalGrad]:
    """This rank's share of every trainable parameter's gradient; under tensor parallelism (the
    run's Topology) the slices of split parameters are marked."""
    out = []
    tp_ids = tensor_parallel_params(engine) if topology.sliced else set()
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        if hasattr(p, "ds_id"):  # ZeRO-3
            from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

            g = safe_get_local_grad(p)
            out.append(LocalGrad(name, None if g is None else g.view(-1), True,
                                 lambda v, p=p: safe_set_local_grad(p, v)))
        elif getattr(p, "_hp_grad", None) is not None and not _is_fragmented(engine):
            out.append(LocalGrad(name, p._hp_grad.view(-1), False, None))  # ZeRO-0 bf16 buffer
        elif hasattr(p, "_hp_mapping") and _is_fragmented(engine):  # ZeRO-1/2
            g = None
            if p._hp_mapping is not None:
                g = p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group).view(-1)
                if g.numel() == p.numel() and p._hp_mapping.lp_fragment_address.numel < p.numel():
                    # a full-size accumulation buffer: this rank owns only its fragment of it
                    a = p._hp_mapping.lp_fragment_address
                    g = g.narrow(0, a.start, a.numel)
            out.append(LocalGrad(name, g, True, None))
        else:
            out.append(LocalGrad(name, None if p.grad is None else p.grad.view(-1), False, None))
        out[-1].tp_sharded = id(p) in tp_ids
        out[-1].expert = expert_slice(p) is not None
    return out


def _is_fragmented(engine) -> bool:
    return engine.zero_optimization_stage() in (1, 2)


def loss_scale(engine) -> float:
    """Gradients under fp16 carry the loss scale; norms and thresholds are in unscaled units."""
    if engine.fp16_enabled():
        return float(getattr(engine.optimizer, "loss_scale", 1.0))
    return 1.0


def grad_norms(engine, grads: List[LocalGrad], topology, device=None) -> torch.Tensor:
    """Whole-parameter L2 norms of the (unscaled) gradients, one per entry, equal on every rank;
    the slices of tensor-parallel parameters summed over the Topology's tensor group, the
    experts split by expert parallelism over their expert-data group (whose partitions are not
    the data-parallel group's under tensor parallelism) and then over the expert group."""
    device = device or next(engine.module.parameters()).device
    sq = torch.zeros(len(grads), dtype=torch.float32, device=device)
    mine = [i for i, g in enumerate(grads) if g.grad is not None and g.grad.numel()]
    if mine:
        parts = [grads[i].grad.float().pow(2).sum() for i in mine]
        sq[mine] = torch.stack(parts).to(device)
    experts = [i for i, g in enumerate(grads) if g.expert]
    if experts:  # this rank's experts over the ranks holding them, then every rank's experts
        expert_sq = sq[experts].clone()
        comm.all_reduce(expert_sq, group=topology.expert_data_group)
        comm.all_reduce(expert_sq, group=topology.expert_group)
        sq[experts] = 0  # kept out of the data-parallel sum below
    if any(g.partitioned for g in grads) and dist.is_initialized():
        # Whole copies must count once: only the first rank of the group contributes them.
        group = data_parallel_group(engine)
        if dist.get_rank(group=group) != 0:
            whole = [i for i, g in enumerate(grads) if not g.partitioned]
            sq[whole] = 0
        comm.all_reduce(sq, group=group)
    sharded = [i for i, g in enumerate(grads) if g.tp_sharded]
    if sharded:  # each tensor-parallel rank holds a different slice of these
        part = sq[sharded].clone()
        comm.all_reduce(part, group=topology.tensor_group)
        sq[sharded] = part
    if experts:
        sq[experts] = expert_sq
    return sq.sqrt() / loss_scale(engine)


def data_parallel_group(engine):
    """The data-parallel group (tensor-parallel ranks excluded)."""
    return getattr(engine, "seq_data_parallel_group", None) or \
        getattr(engine, "data_parallel_group", None)


def scale_(grads: List[LocalGrad], factors: torch.Tensor):
    """Multiply each share by its factor, in place or through the entry's writer."""
    for g, f in zip(grads, factors):
        if g.grad is None or not g.grad.numel():
            continue
        if g.write is None:
            g.grad.mul_(f.to(g.grad.dtype))
        else:
            g.write(g.grad.float() * f)
