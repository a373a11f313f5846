"""Muon's momentum through DeepSpeed's universal checkpoint, which knows Adam's moments only
(DeepSpeed #8608: ds_to_universal reads `exp_avg` and `exp_avg_sq` of every group, and the
universal loaders restore only the state keys a group already holds).

Where DeepSpeed keeps it:
- ZeRO-3: in the sub-group's partition layout, as Adam's moments (`momentum_buffer`, one flat
  tensor the size of the fp32 partition).
- ZeRO-1/2: per rank, the *whole* tensors of the parameters its partition touches, one after
  another in the partition's order (`_muon_momentum_buffer`: Newton-Schulz needs whole matrices,
  so each rank keeps their whole momentum).

The way through:
1. `adam_shaped` (the conversion's reads, universal_stream.py): a Muon group's state is shown to
   ds_to_universal as Adam's: `exp_avg` = the momentum laid out as the fp32 partition (ZeRO-1/2:
   each parameter's slice in the partition cut from its whole tensor), `exp_avg_sq` zeros; its
   fragments are then cut, joined over data-parallel ranks and tensor-parallel slices as any
   moment is.
   So in the universal form a Muon parameter's `exp_avg.pt` holds its momentum and its
   `exp_avg_sq.pt` zeros (the two names DeepSpeed's loaders know).
2. `restore_momentum` (after DeepSpeed's universal load): ZeRO-3 has loaded the two files into
   each sub-group's partition as Adam's moments: Muon's sub-groups get them back under
   `momentum_buffer`. ZeRO-1/2 loads no moment into a group that holds none yet (Muon's buffer
   is made at its first step): each rank's buffer is rebuilt from the whole tensors, cut to its
   tensor-parallel slice (parallel/muon.TensorSlice).
"""
import functools
import re
from pathlib import Path

import torch

MOMENTUM = "momentum_buffer"
_OPTIM_FILE = re.compile(r"(?:.*_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def adam_shaped(obj, path) -> object:
    """`obj` as loaded from `path`, with Muon groups' state in Adam's keys (see the module's
    text); anything else unchanged."""
    match = _OPTIM_FILE.match(Path(str(path)).name) if isinstance(path, (str, Path)) else None
    if match is None or not isinstance(obj, dict):
        return obj
    outer = obj.get("optimizer_state_dict") or {}
    if "base_optimizer_state" in outer:  # ZeRO-1/2
        states = outer["base_optimizer_state"]["state"]
        for i, state in states.items():
            if MOMENTUM in state and "exp_avg" not in state:
                partition = _partition_layout(outer, i, state[MOMENTUM], Path(str(path)).parent,
                                              int(match.group(1)), match.group(2))
                states[i] = {"exp_avg": partition, "exp_avg_sq": torch.zeros_like(partition)}
    elif "optimizer_state_dict" in outer:  # ZeRO-3: already the partition's layout
        states = outer["optimizer_state_dict"]["state"]
        for i, state in states.items():
            if MOMENTUM in state and "exp_avg" not in state:
                momentum = state[MOMENTUM]
                states[i] = {"exp_avg": momentum, "exp_avg_sq": torch.zeros_like(momentum)}
    return obj


@functools.lru_cache(maxsize=None)
def _group_offsets(folder: Path, tensor_rank: str) -> tuple:
    """Per parameter group, name -> (start in the group's flat buffer over all ranks, whole
    numel), from the tensor rank's model-states file. That file holds the module's weights
    too: read once per conversion worker and tensor rank, not once per data-parallel rank's
    optimizer file."""
    states = torch.load(folder / f"mp_rank_{tensor_rank}_model_states.pt", map_location="cpu",
                        weights_only=False)
    groups = []
    for shapes in states["param_shapes"]:
        out, start = {}, 0
        for name, shape in shapes.items():
            numel = torch.Size(shape).numel()
            out[name] = (start, numel)
            start += numel
        groups.append(out)
    return tuple(groups)


def _partition_layout(zero: dict, group: int, whole: torch.Tensor, folder: Path, dp_rank: int,
                      tensor_rank: str) -> torch.Tensor:
    """ZeRO-1/2's whole-tensor momentum of rank `dp_rank`'s partition of `group`, laid out as
    that partition (its fp32 slice's size; padding zero)."""
    fp32 = zero["single_partition_of_fp32_groups"][group]
    mapping = zero["param_slice_mappings"][group]
    paddings = (zero.get("param_alignment_paddings") or [[]])[group]
    if any(paddings):
        raise ValueError(f"{folder}: Muon state with alignment padding between parameters")
    offsets = _group_offsets(folder, tensor_rank)[group]
    partition_start = dp_rank * fp32.numel()
    out = torch.zeros(fp32.numel(), dtype=torch.float32)
    cursor = 0  # in `whole`: the whole tensors of the partition's parameters, in its order
    for name, fragment in mapping.items():
        start, numel = offsets[name]
        into_param = max(0, partition_start - start)
        piece = whole[cursor + into_param: cursor + into_param + fragment.numel]
        out[fragment.start: fragment.start + fragment.numel] = piece.float()
        cursor += numel
    if cursor != whole.numel():
        raise ValueError(f"{folder}: rank {dp_rank}'s Muon momentum holds {whole.numel()} "
                         f"values, its parameters {cursor}")
    return out


def restore_momentum(engine, udir: Path):
    """After DeepSpeed's universal load (see the module's text); nothing without Muon."""
    zero = engine.optimizer
    if not any(g.get("use_muon") for g in getattr(zero, "param_groups", [])):
        return
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
        for i, flat in enumerate(zero.fp32_partitioned_groups_flat):
            if zero.sub_groups_using_muon[i]:
                state = zero.optimizer.state[flat]
                state[MOMENTUM] = state.pop("exp_avg")
                del state["exp_avg_sq"]
        return
    from dr_scale.parallel.muon import TensorSlice

    names = {id(p): n for n, p in engine.module.named_parameters()}
    for i, group in enumerate(zero.optimizer.param_groups):
        if not group.get("use_muon"):
            continue
        pieces = []
        for p in zero.params_in_partition[i]:
            saved = torch.load(udir / "zero" / names[id(p)] / "exp_avg.pt", map_location="cpu",
                               weights_only=False)
            whole = saved["param"] if isinstance(saved, dict) else saved
            slicing = getattr(p, "is_expert_group", None)
            if isinstance(slicing, TensorSlice):
                whole = slicing.mine(whole)
            pieces.append(whole.reshape(-1))
        flat = group["params"][0]
        grads = zero.all_grad_tensors.get(i) if hasattr(zero, "all_grad_tensors") else None
        dtype = grads[0].dtype if grads else torch.float32
        zero.optimizer.state[flat][MOMENTUM] = torch.cat(pieces).to(device=flat.device,
                                                                    dtype=dtype)
