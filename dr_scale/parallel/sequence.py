"""Sequence parallelism (Megatron-LM's): under tensor parallelism, the parts of a block that are
not split by heads or features (norms, residual adds) work on this rank's 1/TP of the sequence
instead of all of it, so their activations shrink by the TP size.

DeepSpeed AutoTP has no sequence-parallel mode (its column layer all-reduces gradients, its row
layer all-reduces outputs), so after AutoTP has split the weights, the forward of its layers is
changed here, each collective going over the same tensor group:

    embedding output        -> keep my sequence chunk          (backward: all-gather)
    column-parallel linear  -> all-gather the sequence, matmul (backward: reduce-scatter; one
                               gather serves the linears that read the same input)
    row-parallel linear     -> matmul, reduce-scatter          (backward: all-gather)
    LM head input           -> all-gather the sequence         (backward: reduce-scatter,
                                                                in place of AutoTP's all-reduce)

The vocabulary-parallel head then sees every token, as without sequence parallelism. Replicated
parameters that now see only this rank's tokens (the norms, row-parallel biases) get their
gradients summed over the tensor group by a hook. The model is unchanged: attention reads the
sequence length from its projections' outputs.

gloo has no reduce-scatter: there it is an all-reduce and a slice (same values, TP x the traffic).
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dr_scale.runtime import comm
from dr_scale.errors import DrScaleError
from dr_scale.models.build import spec_of
from dr_scale.models.lm_head import fuse_vocab_parallel_head, fuses_loss

SEQ = 1  # (batch, sequence, hidden)


def _chunk(x, group):
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(size, dim=SEQ)[rank].contiguous()


def _all_gather(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    comm.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=SEQ)


def _reduce_scatter(x, group):
    if dist.get_backend(group) == "gloo":
        x = comm.all_reduce(x.contiguous(), group=group)
        return _chunk(x, group)
    parts = [p.contiguous() for p in x.chunk(dist.get_world_size(group), dim=SEQ)]
    out = torch.empty_like(parts[0])
    comm.reduce_scatter(out, parts, group=group)
    return out


def _collective(forward_op, backward_op):
    """An autograd op that runs `forward_op` over the group and `backward_op` on its gradient."""
    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward_op(x, group)

        @staticmethod
        def backward(ctx, grad):
            return backward_op(grad, ctx.group), None

    return Op.apply


split = _collective(_chunk, _all_gather)
gather = _collective(_all_gather, _reduce_scatter)
reduce_scatter = _collective(_reduce_scatter, _all_gather)


class _GatherOnce:
    """q, k and v (and gate and up) read the same input: gather it once for all of them, so one
    gathered copy is kept for backward and one reduce-scatter returns its summed gradient."""

    def __init__(self, group):
        self.group, self.input, self.gathered = group, None, None

    def __call__(self, x):
        if x is not self.input:  # identity, not equality: a recomputed input is a new tensor
            self.input, self.gathered = x, gather(x, self.group)
        return self.gathered


def _column_forward(layer, gather_once):
    def forward(x):
        return F.linear(gather_once(x), layer.weight, layer.bias)
    return forward


def _local_forward(layer):
    def forward(x):
        return F.linear(x, layer.weight, layer.bias)
    return forward


def _row_forward(layer):
    def forward(x):
        out = reduce_scatter(F.linear(x, layer.weight), layer.mp_group)
        return out if layer.bias is None else out + layer.bias
    return forward


def _sum_over(group):
    def hook(grad):
        return comm.all_reduce(grad.contiguous(), group=group)
    return hook


def refusals(shape, tp: int, seq_length: int, vocab_parallel: bool, pipeline: int):
    if spec_of(shape.arch).sequence_parallel is None:
        raise DrScaleError(f"parallel.sequence_parallel: built for llama models; model.arch is "
                           f"{shape.arch}")
    if tp == 1 or pipeline > 1:
        raise DrScaleError(f"parallel.sequence_parallel: needs tensor_parallel > 1 and "
                           f"pipeline_parallel=1 (got {tp} and {pipeline})")
    if not vocab_parallel:
        raise DrScaleError("parallel.sequence_parallel: needs parallel.vocab_parallel=true (the "
                           "LM head takes the gathered sequence as a vocabulary slice)")
    if seq_length % tp:
        raise DrScaleError(f"parallel.sequence_parallel: data.seq_length={seq_length} is not a "
                           f"multiple of tensor_parallel={tp}")


def apply(model, arch: str) -> int:
    """Switch AutoTP's layers in `model` (after deepspeed.initialize) to sequence parallelism;
    returns how many layers were changed."""
    from deepspeed.module_inject.layers import (LinearAllreduce, LinearLayer,
                                                VocabParallelLinear)

    embed_name, head_name = spec_of(arch).sequence_parallel  # where it is split and gathered
    modules = dict(model.named_modules())
    group = modules[head_name].mp_group
    gather_once = _GatherOnce(group)
    changed = 0
    for name, m in modules.items():
        if isinstance(m, VocabParallelLinear):  # its input arrives gathered (hook below), whose
            m.forward = _local_forward(m)       # backward already sums over the group
            if fuses_loss(m):
                fuse_vocab_parallel_head(m, m.dr_loss_chunk, input_grads_summed=True)
        elif isinstance(m, LinearAllreduce):
            m.forward = _row_forward(m)
        elif isinstance(m, LinearLayer):
            m.forward = _column_forward(m, gather_once)
        else:
            continue
        changed += 1
    sharded = {id(p) for m in modules.values()
               if isinstance(m, (LinearLayer, LinearAllreduce)) for p in m.parameters()}
    sharded -= {id(m.bias) for m in modules.values()
                if isinstance(m, LinearAllreduce) and m.bias is not None}
    embed_params = {id(p) for p in modules[embed_name].parameters()}
    for p in model.parameters():
        if id(p) not in sharded and id(p) not in embed_params and p.requires_grad:
            p.register_hook(_sum_over(group))  # norms (and row biases) saw only my tokens
    modules[embed_name].register_forward_hook(lambda m, args, out: split(out, group))
    modules[head_name].register_forward_pre_hook(
        lambda m, args: (gather(args[0], group), *args[1:]))
    return changed
