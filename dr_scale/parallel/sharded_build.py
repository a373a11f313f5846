"""Building the model so that no rank ever holds all of it.

- ZeRO-3 without tensor or pipeline parallelism: the model is constructed inside DeepSpeed's
  `zero.Init`: each submodule's parameters are cast to the training precision and partitioned
  across the data-parallel ranks as soon as that submodule exists, so a rank holds one module
  whole at most while building, then its 1/N shard. The values are set after zero.Init has
  closed, each rank drawing its own partition's only.
- Tensor or pipeline parallelism: the model is built on the meta device (nothing allocated),
  cut into this rank's pipeline stage and split into its tensor-parallel slices there
  (parallel/parallelize.py), and only then made real by `materialize`: each parameter left on
  this rank gets its initial value, only its slice drawn, or the init_from folder's, read whole
  one tensor at a time and cut to this rank's slice. A rank holds its own slices of its own
  stage, plus one whole tensor of an init_from folder while it is cut.
- Otherwise every rank builds the whole model (it keeps all of it anyway).

Every way gives each parameter the same values from the same seed: element i of a tensor is
the same number whoever draws it (models/initial_values.py). Nothing is drawn where a checkpoint
or an init_from folder supplies the values next (`draw=False`, LOADED_LATER): a requeued 70B job
would otherwise draw the whole model again on every rank before loading over it.
"""
from contextlib import contextmanager

import torch
from torch import nn

from dr_scale.config import ds_config as dsc
from dr_scale.models import build_model
from dr_scale.models.build import construct, initialize
from dr_scale.models.initial_values import fill_block, fill_values, initial_value
from dr_scale.models.layers import initial_rules
from dr_scale.parallel.topology import Topology
from dr_scale.runtime.ranks import local_rank

ORIGIN = "dr_origin"  # attribute of a parameter built on meta: (name, whole shape, initial rule)
LOADED_LATER = "loaded later"  # `materialize`'s weights: zeros, a checkpoint's values come next


def builds_sharded(ds: dict, topo: Topology) -> bool:
    return dsc.zero_stage(ds) == 3 and not topo.builds_on_meta


def build_for_run(shape, ds: dict, topo: Topology, draw: bool = True) -> nn.Module:
    """`draw=False`: parameters zero, not drawn (a checkpoint or init_from supplies them); a
    model built on meta is made real later, by `materialize`."""
    if topo.builds_on_meta:
        model = build_model(shape, device="meta")
        for name, rule in initial_rules(model, shape.init_std, shape.num_layers).items():
            param = model.get_parameter(name)
            setattr(param, ORIGIN, (name, tuple(param.shape), rule))
        return model
    if not builds_sharded(ds, topo):
        return build_model(shape, draw=draw)
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    # While zero.Init is open, every floating tensor torch's constructors make is cast to the
    # training dtype and put on the accelerator, whatever dtype and device are asked for. Only
    # the structure is made inside it; the values (random draws from CPU generators, in fp32)
    # are set after it has closed, each rank drawing its own partition's.
    init = deepspeed.zero.Init(config_dict_or_path=ds)
    with init, _default_dtype(init.dtype):
        model = construct(shape)
    if draw:
        initialize(model, shape)
    else:  # each rank's own partition, no gathering
        with torch.no_grad():
            for param in model.parameters():
                param.ds_tensor.zero_()
    # computed buffers (CPU, fp32) go where zero.Init put the parameters (its local_device);
    # the engine moves the buffers of a model built otherwise, but not of a zero.Init one
    _buffers_to(model, torch.device(get_accelerator().device_name(local_rank())))
    return model


@contextmanager
def _default_dtype(dtype: torch.dtype):
    """torch's default dtype set to zero.Init's while it is open: its constructors then make
    parameters in the training dtype at once, where a default fp32 tensor is allocated, touched
    and converted (0.86 s of a 1-rank llama_1b/8-layer start-up, py-spy, AMD EPYC). The values
    are drawn in fp32 after it closes either way; computed buffers say their dtype."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _buffers_to(model: nn.Module, device: torch.device):
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            setattr(module, name, buf.to(device))


def zero3_partitioner(ds: dict, mpu):
    """For `materialize` under ZeRO-3 with tensor parallelism: each module's slices, as soon as
    they are real, become ZeRO-3 parameters partitioned over the data-parallel group (DeepSpeed's
    zero.Init converting an allocated module, as deepspeed.initialize would convert the whole
    model later), so a rank never holds all its slices at once."""
    import deepspeed

    def partition(owner: nn.Module):
        # mem_efficient_linear would replace torch's F.linear for the whole process
        # (mpu: the batch sizes check out against the data-parallel ranks, not the world)
        deepspeed.zero.Init(module=owner, config_dict_or_path=ds, mpu=mpu,
                            data_parallel_group=mpu.get_data_parallel_group(),
                            mem_efficient_linear=False)
    return partition


@torch.no_grad()
def materialize(module: nn.Module, weights=None, dtype=None, partition=None) -> int:
    """Make every parameter and buffer of `module` (this rank's stage and slices of a model built
    on meta) real on the CPU: its initial value, or `weights`'s (an export.safetensors_folder
    .HFWeights, by the model's parameter names), this rank's slice of it (zeros where `weights`
    is LOADED_LATER), in `dtype` (the training precision: DeepSpeed would cast it so, and the
    fp32 copy is never held). Modules are
    visited children first; `partition(owner)`, where given, runs on each module whose own
    parameters were just made (zero3_partitioner). Returns the number of elements made."""
    made = 0
    for owner in reversed(list(module.modules())):  # every module after all of its children
        made_here = 0
        for param in owner.parameters(recurse=False):
            if not param.is_meta:  # a tied weight, made through its other owner
                continue
            name, whole_shape, rule = getattr(param, ORIGIN)
            part = torch.empty(param.shape, dtype=dtype or param.dtype)
            dim, first = _this_ranks_slice(owner, whole_shape, tuple(param.shape), name)
            if weights is LOADED_LATER:
                part.zero_()
            elif weights is None and dim in (None, 0):
                # the whole tensor or whole rows: one range of the flat order, only it drawn
                row = part[0].numel() if part.dim() else 1
                fill_values(rule, whole_shape, name, first * row, part.view(-1))
            elif weights is None and dim == len(whole_shape) - 1:
                # whole columns (a row-parallel slice): only the tiles of its columns drawn
                rows = range(part.numel() // part.shape[-1])
                columns = range(first, first + part.shape[-1])
                fill_block(rule, whole_shape, name, rows, columns, part.view(len(rows), -1))
            else:
                whole = initial_value(rule, whole_shape, name) if weights is None \
                    else weights.read(name)
                part.copy_(whole if dim is None else whole.narrow(dim, first, part.shape[dim]))
            made_here += part.numel()
            # A meta parameter cannot take CPU data (set_data refuses the device change), so
            # the parameter object itself is swapped: every module sharing it (tied weights,
            # pipeline stages) and DeepSpeed's attributes on it stay. Gradient hooks on it
            # would not; AutoTP adds them only for plans asking grad_allreduce, ours do not.
            if getattr(param, "_ds_grad_allreduce_registered", False):
                raise RuntimeError(f"{name}: a gradient hook on a meta parameter would be lost")
            real = nn.Parameter(part, requires_grad=param.requires_grad)
            real.__dict__.update(param.__dict__)
            torch.utils.swap_tensors(param, real)
        if any(b.is_meta for b in owner.buffers(recurse=False)):
            owner.init_buffers()  # computed tables (the rotary ones), not parameters
        if made_here and partition is not None:
            partition(owner)
        made += made_here
    return made


def _this_ranks_slice(owner: nn.Module, whole_shape: tuple, shape: tuple, name: str):
    """Where the part AutoTP's layer `owner` keeps on this rank starts: (the dimension split by
    the layer's partition sizes, this rank's first index along it, by its tp_index), or
    (None, 0) for the whole tensor."""
    if tuple(whole_shape) == shape:
        return None, 0
    if hasattr(owner, "slice_start"):  # a slice of our own (parallel/expert.py)
        return owner.slice_start()
    split = [d for d, (a, b) in enumerate(zip(whole_shape, shape)) if a != b]
    if len(split) != 1 or not hasattr(owner, "_partition_sizes"):
        raise RuntimeError(f"{name}: cannot tell this rank's part of {tuple(whole_shape)} "
                           f"as {shape} ({type(owner).__name__})")
    return split[0], sum(list(owner._partition_sizes)[:owner.tp_index])
