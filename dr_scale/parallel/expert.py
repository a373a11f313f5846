"""Expert parallelism: each mixture-of-experts block's experts split over `parallel.expert_parallel`
consecutive data-parallel ranks (DeepSpeed's expert-parallel group); every token is routed on
its own rank, travels to the rank holding its expert by all-to-all, and comes back the same way.

What each rank keeps: its experts' slice (E / EP of each stacked w1, w2, w3), the rest of the
model whole. The experts' gradients are reduced over their expert-data group (the ranks holding
the same slice), the rest over all data-parallel ranks: DeepSpeed's ZeRO-1/2 optimizer does
both, for the parameters it finds marked as experts (`allreduce=False`, `group_name`) in a
parameter group marked `moe` (train/engine.py), once its engine has found an MoE layer. Its
ZeRO-3 partitions the experts over their expert-data group by AutoEP's placement marks
(`ds_zero_placement_family`, `ds_zero_partition_group_name`), when the engine itself makes
them ZeRO-3 parameters: so not under tensor parallelism, where each slice is partitioned as it
is made (refused).

Why DeepSpeed's AutoEP layer class (and not its `moe.layer.MoE`): the engine turns on its MoE
handling (expert groups, the experts' checkpoint files) only for modules of those two classes,
and AutoEP's keeps the layout our layer has (stacked `experts.w1/w2/w3`, one file per expert in
a checkpoint), where `MoE` expects one module per expert. Our SparseMoE takes the class on
(`ExpertParallelMoE`) with the attributes the engine reads; AutoEP's own constructor, which
replaces a transformers block and its router, is not run.
"""
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch import nn

from dr_scale.errors import DrScaleError
from dr_scale.kernels import ops
from dr_scale.runtime import comm
from dr_scale.models.moe import Experts, SparseMoE
from dr_scale.parallel.topology import Topology


def refusals(shape, topo: Topology, zero: int, compile_on, ds_path) -> None:
    if not topo.experts_split:
        return
    key = f"parallel.expert_parallel={topo.expert}"
    if shape.moe is None:
        raise DrScaleError(f"{key}: the model has no experts; use a mixture-of-experts preset "
                           "(model.preset=moe_tiny, mixtral_8x7b, ...) or expert_parallel=1")
    if shape.moe.num_experts % topo.expert:
        raise DrScaleError(f"{key}: must divide model.moe.num_experts={shape.moe.num_experts} "
                           "(each rank holds the same number of experts)")
    if topo.pipeline > 1:
        raise DrScaleError(f"{key} with pipeline_parallel={topo.pipeline}: DeepSpeed's pipeline "
                           "engine has no expert groups; set pipeline_parallel=1 (tensor and "
                           "data parallelism combine with it)")
    if zero == 0:
        raise DrScaleError(
            f"{ds_path}: zero_optimization.stage=0 with {key}: DeepSpeed reduces the experts' "
            "gradients over their expert-data groups in its ZeRO optimizers only; use zero1, "
            "zero2 or zero3")
    if zero == 3 and topo.sliced:
        raise DrScaleError(
            f"{ds_path}: zero_optimization.stage=3 with {key} and parallel.tensor_parallel="
            f"{topo.tensor}: each rank's tensor-parallel slices are partitioned over the "
            "data-parallel group as they are made, which DeepSpeed then refuses for experts "
            "(they must be partitioned over their expert-data group); use zero1 or zero2 with "
            "tensor parallelism, or tensor_parallel=1")
    if compile_on:
        raise DrScaleError(f"model.compile=true with {key}: the all-to-all of the tokens breaks "
                           "each block's graph; set model.compile to false or auto")


class ExpertShard(Experts):
    """This rank's experts of one block (consecutive, `first` the first one's global index), and
    the all-to-all that brings each expert its rows from every rank of the group."""

    def __init__(self, whole: Experts, topo: Topology):
        nn.Module.__init__(self)
        self.num_experts = whole.w1.shape[0]
        self.ep_size, self.ep_rank = topo.expert, topo.expert_rank
        self.num_local = self.num_experts // self.ep_size
        self.first = self.ep_rank * self.num_local
        self.group = topo.expert_group
        # Under tensor parallelism the tensor group's ranks hold the same experts and compute
        # the same gradients, and DeepSpeed's expert-data group (whose sum over DP ranks makes
        # the average) holds them all: each contributes 1/TP
        self.grad_scale = 1 / topo.tensor
        for name in ("w1", "w2", "w3"):
            p = getattr(whole, name)
            part = nn.Parameter(torch.empty((self.num_local, *p.shape[1:]), device=p.device,
                                            dtype=p.dtype), requires_grad=p.requires_grad)
            part.__dict__.update(p.__dict__)  # the build's record of the whole tensor (meta)
            setattr(self, name, part)

    def slice_start(self):
        """(the dimension cut, this rank's first index along it): parallel/sharded_build."""
        return 0, self.first

    def forward(self, x, counts):
        """`x`: this rank's routed rows grouped by (global) expert, `counts[e]` of them for
        expert e; returns the experts' outputs in the same order."""
        size, local = self.ep_size, self.num_local
        # every rank's counts: how many rows each source sends to each of my experts
        gathered = [torch.empty_like(counts) for _ in range(size)]
        comm.all_gather(gathered, counts, group=self.group)
        received = torch.stack(gathered)[:, self.first:self.first + local]   # (source, local)
        # the all-to-all's sizes are the host's: one wait on the device for the layer, all of
        # them read at once
        sizes = torch.cat([counts.view(size, local).sum(1), received.sum(1)]).tolist()
        send, recv = sizes[:size], sizes[size:]
        rows = _all_to_all(x, recv, send, self.group)
        # arrived by (source, expert); the experts want them by (expert, source)
        block = torch.repeat_interleave(torch.arange(size * local, device=x.device),
                                        received.flatten(), output_size=sum(recv))
        by_expert = torch.argsort((block % local) * size + block // local, stable=True)
        weights = [self.w1, self.w2, self.w3]
        if self.grad_scale != 1:
            weights = [ScaleGradient.apply(w, self.grad_scale) for w in weights]
        out = ops.grouped_experts(rows[by_expert], *weights, received.sum(0))
        out = out[torch.argsort(by_expert)]
        return _all_to_all(out, send, recv, self.group)


class ScaleGradient(torch.autograd.Function):
    """The identity, its gradient scaled."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _all_to_all(x, output_splits, input_splits, group):
    """Rows of `x` to the group's ranks (input_splits[r] to rank r), theirs back (its backward:
    the gradients the reverse way)."""
    out = all_to_all_single_autograd(x, output_splits, input_splits, group)
    return out.wait() if hasattr(out, "wait") else out


def _autoep_class():
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    class ExpertParallelMoE(SparseMoE, AutoEPMoELayer):
        """SparseMoE as DeepSpeed's engine recognises an expert-parallel layer (the class is all
        it checks; forward and the parameters are SparseMoE's)."""

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_=False,
                                      folding_group_handles=None):
            from deepspeed.utils import groups

            self.ep_group = groups._get_expert_parallel_group(self.ep_group_name)

    return ExpertParallelMoE


def split_experts(model: nn.Module, topo: Topology) -> int:
    """Replace every block's experts by this rank's slice of them (on meta: made real later by
    parallel/sharded_build.materialize, this rank's experts only) and mark the parameters as
    DeepSpeed's engine and optimizer look for them. Returns the number of blocks split."""
    from deepspeed.checkpoint.autoep_affine import (autoep_experts_for_rank,
                                                    autoep_placement_to_affine_map,
                                                    legacy_uniform_autoep_placement_descriptor)
    from deepspeed.checkpoint.constants import (AFFINE_MAP, AUTOEP_EXPERT_PLACEMENT,
                                                AUTOEP_PARAM_EP_RANK, AUTOEP_PARAM_LOCAL_EXPERTS,
                                                AUTOEP_PARAM_LOGICAL_SHAPE, DS_AUTOEP_UC_META)

    group = topo.expert_group
    if group is not None and dist.get_rank(group) != topo.expert_rank:  # our layout, DeepSpeed's
        raise RuntimeError(f"rank {topo.rank}: expert rank {topo.expert_rank} by the topology, "
                           f"{dist.get_rank(group)} in DeepSpeed's expert group")
    layer_class = _autoep_class()
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for moe in blocks:
        moe.experts = shard = ExpertShard(moe.experts, topo)
        moe.__class__ = layer_class
        # what the engine reads of an AutoEP layer
        moe.num_experts, moe.num_local_experts = shard.num_experts, shard.num_local
        moe.ep_size, moe.ep_rank = shard.ep_size, shard.ep_rank
        moe.ep_group_name, moe.ep_group = f"ep_size_{topo.expert}", topo.expert_group
        moe.expert_placement_descriptor = legacy_uniform_autoep_placement_descriptor(
            shard.num_experts, shard.num_local, shard.ep_size)
        local = list(autoep_experts_for_rank(moe.expert_placement_descriptor, shard.ep_rank))
        for param in shard.parameters():
            logical = [shard.num_experts, *param.shape[1:]]
            affine = autoep_placement_to_affine_map(moe.expert_placement_descriptor, logical)
            param.allreduce = False  # reduced over the expert-data group, not all of DP
            # ZeRO-3 partitions it over the expert-data group (DeepSpeed's AutoEP placement)
            param.ds_zero_placement_family = "autoep_expert"
            param.ds_zero_partition_group_name = moe.ep_group_name
            param.expert_slice = (shard.first, shard.num_experts)  # read by expert_slice()
            param.group_name = moe.ep_group_name
            # Under TP the expert-data group spans the tensor group, so a rank's ZeRO partition
            # of the experts is its own, not a replica; DeepSpeed's gradient norm counts a
            # replicated parameter's partition on tensor rank 0 only, a model-parallel one's on
            # every rank (measured: the norm came out 0.3% low, clipping the step differently)
            param.model_parallel = topo.tensor > 1
            setattr(param, DS_AUTOEP_UC_META, {
                AUTOEP_EXPERT_PLACEMENT: moe.expert_placement_descriptor,
                AFFINE_MAP: affine.to_dict(), AUTOEP_PARAM_LOGICAL_SHAPE: logical,
                AUTOEP_PARAM_EP_RANK: shard.ep_rank, AUTOEP_PARAM_LOCAL_EXPERTS: local})
    _experts_out_of_autotp_record(model)
    return len(blocks)


def expert_slice(param):
    """(the global index of this rank's first expert, the number of experts) for a parameter
    split by expert parallelism; None for every other parameter (whole on each rank, or split by
    tensor parallelism, which the callers handle apart)."""
    return getattr(param, "expert_slice", None)


def _experts_out_of_autotp_record(model: nn.Module) -> None:
    """Under tensor parallelism AutoTP's record for the universal conversion (parallel/
    tensor.py) lists the experts as replicated over the tensor group; the conversion joins them
    as experts instead, and refuses a record pattern it did not use."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    info = getattr(model, UNIVERSAL_CHECKPOINT_INFO, None)
    if not info:
        return
    for key, value in info.items():
        if isinstance(value, list):
            info[key] = [p for p in value if not (isinstance(p, str) and "experts" in p)]
    params = (info.get("affine_map") or {}).get("params")
    if isinstance(params, dict):
        for pattern in [p for p in params if "experts" in p]:
            del params[pattern]


def expert_groups(param_groups: list) -> list:
    """The optimizer's parameter groups with the experts' parameters in groups of their own,
    marked `moe` (DeepSpeed's ZeRO-1/2 optimizer reduces those over the expert-data group)."""
    if not any(getattr(p, "allreduce", True) is False
               for g in param_groups for p in g["params"]):
        return param_groups
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    return split_params_into_different_moe_groups_for_optimizer(param_groups)
