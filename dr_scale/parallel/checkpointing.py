"""Activation checkpointing applied to a built model without changing its parameter names:
the chosen modules' forward methods are wrapped so their activations are recomputed in the
backward pass instead of kept.

    none       keep everything
    full       every k-th decoder block (parallel.checkpoint_every = k) keeps only its input
    selective  only the attention of every k-th block (cheap to recompute, large to keep at
               long sequences without flash attention)

Recomputation is torch's non-reentrant checkpoint (it restores the CPU and CUDA RNG state, so
recomputed dropout masks equal the first pass). DeepSpeed's own non-reentrant checkpoint is used
only when the DeepSpeed config asks for `activation_checkpointing.partition_activations` (the kept
block inputs split across the tensor group), which only it does. It cannot run under ZeRO-3:
the recomputed forward meets parameters ZeRO-3 has already released ("size of tensor a (0) must
match ...", DeepSpeed issue 4595, reproduced with 0.19.8), so that pair is refused at start.
Its `cpu_checkpointing` is refused too: with DeepSpeed 0.19.8 the recomputed block got an fp32
input beside bf16 weights ("expected m1 and m2 to have the same dtype"); not traced further.
"""
import functools

import deepspeed
import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from dr_scale.config.ds_config import zero_stage
from dr_scale.errors import DrScaleError
from dr_scale.models.layers import SelfAttention, decoder_blocks


def _checkpointed(forward, partitioned, *args, **kwargs):
    leaves, spec = tree_flatten((args, kwargs))
    # Only activations (tensors that carry gradients) go through the checkpoint; constants such as
    # the rotary tables are closed over: DeepSpeed's partitioned and CPU checkpointing pair each
    # argument with its saved size and mis-pair them when constants are among the arguments.
    slots = [i for i, v in enumerate(leaves) if torch.is_tensor(v) and v.requires_grad]

    def run(*activations):
        flat = list(leaves)
        for i, v in zip(slots, activations):
            flat[i] = v
        a, kw = tree_unflatten(flat, spec)
        return forward(*a, **kw)
    activations = [leaves[i] for i in slots]
    if partitioned:
        return deepspeed.checkpointing.non_reentrant_checkpoint(run, *activations)
    return torch.utils.checkpoint.checkpoint(run, *activations, use_reentrant=False)


def refusals(ds_config: dict, source: str = "the DeepSpeed config"):
    """Refuse what our checkpointing cannot run with (before anything is built)."""
    section = (ds_config or {}).get("activation_checkpointing", {})
    if section.get("cpu_checkpointing"):
        raise DrScaleError(f"{source}: activation_checkpointing.cpu_checkpointing=true: DeepSpeed's "
                           f"non-reentrant checkpointing fails with it in the backward pass; set "
                           f"it to false (parallel.activation_checkpointing still applies)")
    if section.get("partition_activations") and zero_stage(ds_config or {}) == 3:
        raise DrScaleError(f"{source}: activation_checkpointing.partition_activations=true with "
                           f"ZeRO-3: DeepSpeed's checkpointing, which partitions, recomputes on "
                           f"parameters ZeRO-3 has released (DeepSpeed issue 4595); set it to "
                           f"false (parallel.activation_checkpointing still applies) or use ZeRO-1/2")


def compile_problem(zero_stage: int, checkpointing: str):
    """Why the blocks cannot be compiled in this layout, or None. (ZeRO-3 compiles: its
    gathering hooks are compiler-disabled; gathered by block (parallel/zero3_gather.py) they sit
    at the block's edges and the block is one graph, gathered by module they split it.)"""
    if checkpointing != "none":
        return "parallel.activation_checkpointing: not combined with compiling yet; choose one"
    return None


def compile_refusals(zero_stage: int, checkpointing: str):
    problem = compile_problem(zero_stage, checkpointing)
    if problem:
        raise DrScaleError(f"model.compile=true with {problem}, or model.compile=false (auto "
                           "picks eager here)")


def apply(model: nn.Module, mode: str, every: int = 1, ds_config: dict = None, mpu=None) -> int:
    """Wrap the modules `mode` names; returns how many were wrapped (`refusals` ran in the
    plan)."""
    if mode == "none":
        return 0
    partitioned = bool((ds_config or {}).get("activation_checkpointing", {})
                       .get("partition_activations"))
    deepspeed.checkpointing.configure(mpu, partition_activations=partitioned,
                                      checkpoint_in_cpu=False,
                                      contiguous_checkpointing=False, synchronize=False,
                                      profile=False)
    blocks = decoder_blocks(model)[::every]
    targets = blocks if mode == "full" else [
        c for b in blocks for c in b.children() if isinstance(c, SelfAttention)]
    for m in targets:
        m.forward = functools.partial(_checkpointed, m.forward, partitioned)
    return len(targets)


def compile_blocks(model: nn.Module, zero_stage: int, checkpointing: str) -> int:
    """torch.compile each decoder block in place (parameter names unchanged): one compiled
    region per block type, reused by every block, as torchtitan does; returns how many
    (`compile_refusals` ran in the plan)."""
    blocks = decoder_blocks(model)
    for b in blocks:
        b.compile()
    return len(blocks)
